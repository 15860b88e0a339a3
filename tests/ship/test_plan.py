"""`aioinfer plan` against what the server really does: parameter counts against transformers,
every KV number against the model runner and the live server's startup log, the activation
estimate against torch's memory profiler, and (marked `gpu`) the whole plan against `serve` on
CUDA."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, PretrainedConfig

from aioinfer import sizing
from aioinfer.cli import plan as plan_module
from aioinfer.cli.plan import (
    DTYPE_BYTES,
    GiB,
    build_plan_configs,
    count_parameters,
    default_token_budget,
    estimate_activation_bytes,
    make_plan,
    plan_main,
)
from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.gpu import kv_cache
from aioinfer.gpu.runner import ModelRunner
from aioinfer.model.loader.resolve import BUNDLED_CONFIGS, resolve_model
from aioinfer.model.registry import get_model_class
from aioinfer.sizing import kv_cache_too_small
from tests.ship.conftest import LiveServer, cli_flags
from tests.support.fake_cuda import FakeDevice
from tests.support.serve_process import ServeProcess, free_port
from tests.support.tiny_models import ARCH_CONFIG, ARCHS, BASE_CONFIG, VARIANTS

TOLERANCE = 0.02


def variant_config(name: str, **overrides: Any) -> PretrainedConfig:
    arch, variant_overrides = VARIANTS[name]
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(**{**BASE_CONFIG, **ARCH_CONFIG[arch], **variant_overrides, **overrides})
    config.architectures = [model_cls.__name__]
    return config


def config_dir(tmp_path: Path, config: PretrainedConfig) -> Path:
    config.save_pretrained(tmp_path)
    return tmp_path


def decoder_config(hf_config: Any) -> Any:
    return get_model_class(hf_config).decoder_config(hf_config)


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parameter_count_equals_transformers(name):
    config = variant_config(name)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config).num_parameters()
    assert count_parameters(decoder_config(config)) == reference


@pytest.mark.parametrize("model", sorted(BUNDLED_CONFIGS))
def test_parameter_count_of_the_bundled_configs(model):
    config = resolve_model(model, load_format="dummy").hf_config
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config).num_parameters()
        ours = sum(p.numel() for p in get_model_class(config)(config).parameters())
    assert count_parameters(decoder_config(config)) == hf == ours


# ----------------------------------------------------------------------------- the CPU runner


CPU_CASES = {
    "llama": ("llama", {}),
    "qwen2-tied-bf16-block32": ("qwen2-tied", {"dtype": "bfloat16", "block_size": 32}),
    "qwen3-short": ("qwen3", {"max_model_len": 100, "kv_cache_memory": 0.003}),
    # vLLM's flag, in bytes, over --kv-cache-memory.
    "llama-bytes": ("llama", {"kv_cache_memory_bytes": 3_000_000, "kv_cache_memory": 1.0}),
    "mha-override": ("llama-mha", {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 64}),
    # Embeddings: the untied LM head is neither loaded nor counted.
    "llama-pooling": ("llama", {"runner": "pooling", "pooler_config": '{"pooling_type": "MEAN"}'}),
    # Experts in one layer, the dense MLP in the other.
    "qwen3-moe": ("qwen3-moe", {}),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_plan_equals_the_model_runner_on_cpu(case, tmp_path):
    variant, flags = CPU_CASES[case]
    folder = config_dir(tmp_path, variant_config(variant))
    model_config, cache_config, scheduler_config = build_plan_configs(
        {"model": str(folder), "device": "cpu", **flags}
    )
    plan = make_plan(model_config, cache_config, scheduler_config)
    runner_model_config = ModelConfig(**{**model_config.__dict__, "load_format": "dummy"})
    resolved = ModelRunner.resolve(runner_model_config)
    info = ModelRunner(resolved, runner_model_config, cache_config, scheduler_config).info
    assert plan.problem is None
    assert (plan.device, plan.dtype) == (info.device, info.dtype)
    assert plan.weights_gib == info.weights_gib
    assert plan.available_kv_gib == info.available_kv_gib
    assert plan.num_blocks == info.num_blocks
    assert plan.kv_capacity_tokens == info.kv_capacity_tokens
    assert plan.max_concurrency == info.max_concurrency
    assert plan.max_model_len == info.max_model_len
    assert plan.max_num_batched_tokens == info.max_num_batched_tokens
    if "kv_cache_memory_bytes" in flags:
        assert info.available_kv_gib * GiB == flags["kv_cache_memory_bytes"]


def test_plan_of_a_classifier_counts_its_score_head(tmp_path):
    config = variant_config("qwen2", num_labels=3)
    config.architectures = ["Qwen2ForSequenceClassification"]
    folder = config_dir(tmp_path, config)
    configs = build_plan_configs({"model": str(folder), "device": "cpu"})
    plan = make_plan(*configs)
    runner_model_config = ModelConfig(**{**configs[0].__dict__, "load_format": "dummy"})
    resolved = ModelRunner.resolve(runner_model_config)
    runner = ModelRunner(resolved, runner_model_config, configs[1], configs[2])
    assert runner.info.pooler is not None and len(runner.info.pooler.labels) == 3
    assert plan.num_parameters == sum(p.numel() for p in runner.model.parameters())
    assert plan.weights_gib == runner.info.weights_gib


def test_the_kv_cache_refusal_names_the_longest_context_that_fits():
    assert kv_cache_too_small(112, 8, 16) is None  # 7 blocks of 16 after the null block
    assert "(113) is larger" in kv_cache_too_small(113, 8, 16)
    assert "decrease --max-model-len to at most 112." in kv_cache_too_small(113, 8, 16)
    no_room = kv_cache_too_small(16, 1, 16)
    assert "(0 tokens in 1 block). Increase" in no_room and "decrease" not in no_room


def test_plan_and_runner_refuse_the_same_settings(tmp_path, capsys):
    folder = config_dir(tmp_path, variant_config("llama"))
    # 8 KiB blocks (2 layers x 2 KV heads x 16 dims x 16 tokens x K and V x 4 bytes): 2 of them.
    flags = {"device": "cpu", "kv_cache_memory": 0.00002}
    configs = build_plan_configs({"model": str(folder), **flags})
    plan = make_plan(*configs)
    assert plan.problem is not None and "max model len (256)" in plan.problem
    assert "decrease --max-model-len to at most 16." in plan.problem  # one 16-token block
    runner_model_config = ModelConfig(model=str(folder), device="cpu", load_format="dummy")
    with pytest.raises(ValueError, match=re.escape(plan.problem)):
        ModelRunner(ModelRunner.resolve(runner_model_config), runner_model_config, *configs[1:])
    assert plan_main(str(folder), **flags) == 1
    assert "serve would not start" in capsys.readouterr().out


def test_a_cpu_kv_cache_beyond_the_machine_is_refused_by_plan_and_runner(tmp_path, monkeypatch):
    """More KV cache than the machine's memory: one line from both (it was an ENOMEM
    traceback from the runner, and plan passed it)."""
    monkeypatch.setattr(sizing, "host_memory_bytes", lambda: GiB)
    monkeypatch.setattr(plan_module, "host_memory_bytes", lambda: GiB)
    folder = config_dir(tmp_path, variant_config("llama"))
    flags = {"device": "cpu", "kv_cache_memory": 1.5}
    configs = build_plan_configs({"model": str(folder), **flags})
    problem = make_plan(*configs).problem
    assert problem is not None and "than the memory this process may use (1.00 GiB" in problem
    runner_model_config = ModelConfig(model=str(folder), device="cpu", load_format="dummy")
    with pytest.raises(ValueError, match=re.escape(problem)):
        ModelRunner(ModelRunner.resolve(runner_model_config), runner_model_config, *configs[1:])
    configs = build_plan_configs({"model": str(folder), "device": "cpu", "kv_cache_memory": 0.5})
    assert make_plan(*configs).problem is None


def test_kv_bytes_on_a_gpu_are_checked_against_what_the_weights_leave(tmp_path):
    """--kv-cache-memory-bytes on a GPU: taken as given, outside the utilization share, and
    refused beyond the memory the weights leave, as serve refuses it."""
    folder = config_dir(tmp_path, variant_config("llama"))
    fits = build_plan_configs({"model": str(folder), "kv_cache_memory_bytes": 20 * GiB,
                               "gpu_memory_utilization": 0.1})  # fmt: skip
    plan = make_plan(*fits, gpu_memory_gib=24, non_torch_gib=0.25)
    assert plan.problem is None and plan.available_kv_gib == 20.0
    too_big = build_plan_configs({"model": str(folder), "kv_cache_memory_bytes": 24 * GiB})
    problem = make_plan(*too_big, gpu_memory_gib=24, non_torch_gib=0.25).problem
    assert problem is not None and "kv_cache_memory_bytes asks for 24.00 GiB" in problem


def test_a_model_that_fills_the_share_is_not_told_to_shrink_the_step(tmp_path):
    """The advice when no KV memory is left: the model, not the step budget, where the
    model alone takes the engine's whole share of the GPU."""
    folder = config_dir(tmp_path, variant_config("llama"))
    configs = build_plan_configs({"model": str(folder)})
    plan = make_plan(*configs, gpu_memory_gib=24, non_torch_gib=0.25)
    crowded = dataclasses.replace(plan, weights_bytes=23 * GiB, available_kv_bytes=-GiB)
    assert "The model alone takes 23.25 GiB" in crowded.problem
    assert "max-num-batched-tokens" not in crowded.problem
    busy = dataclasses.replace(plan, available_kv_bytes=-GiB)  # a tiny model, a huge step
    assert "lower --max-num-batched-tokens" in busy.problem


# ----------------------------------------------------------------------------- the live server


def served_numbers(log: list[str]) -> dict[str, float]:
    text = "\n".join(log)
    size = re.search(r"KV cache size: (\d+) tokens, Maximum concurrency for (\d+) tokens per "
                     r"request: ([\d.]+)x", text)  # fmt: skip
    weights = re.search(r"Model loading took ([\d.]+) GiB memory", text)
    kv = re.search(r"Available KV cache memory: ([\d.]+) GiB", text)
    assert size and weights and kv, text
    return {
        "kv_tokens": int(size[1]),
        "max_model_len": int(size[2]),
        "concurrency": float(size[3]),
        "weights_gib": float(weights[1]),
        "kv_gib": float(kv[1]),
    }


def assert_plan_matches(plan: Any, served: dict[str, float]) -> None:
    assert plan.max_model_len == served["max_model_len"]
    assert plan.kv_capacity_tokens == pytest.approx(served["kv_tokens"], rel=TOLERANCE)
    assert plan.max_concurrency == pytest.approx(served["concurrency"], rel=TOLERANCE, abs=0.01)
    assert plan.weights_gib == pytest.approx(served["weights_gib"], rel=TOLERANCE, abs=1e-4)
    assert plan.available_kv_gib == pytest.approx(served["kv_gib"], rel=TOLERANCE, abs=0.01)


def test_plan_matches_the_live_servers_startup_log(live_server: LiveServer, capsys):
    served = served_numbers(live_server.log)
    flags = {"model": str(live_server.model_dir), **live_server.flags}
    plan = make_plan(*build_plan_configs(flags))
    assert_plan_matches(plan, served)
    # On the CPU nothing is estimated: the numbers are the same ones.
    assert plan.kv_capacity_tokens == served["kv_tokens"]
    assert plan_main(str(live_server.model_dir), as_json=True, **live_server.flags) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kv_capacity_tokens"] == served["kv_tokens"]
    assert printed["served_name"] == "tiny"


# ----------------------------------------------------------------------------- the formulas


@pytest.mark.parametrize("offline", [False, True])
@pytest.mark.parametrize("total_gib", [8, 24, 69.9, 70, 80, 141])
def test_default_token_budget_follows_the_runner(monkeypatch, total_gib, offline):
    total = int(total_gib * GiB)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total)
    )
    expected = kv_cache.default_token_budget(torch.device("cuda"), offline)
    assert default_token_budget("cuda", total, offline) == expected
    cpu = kv_cache.default_token_budget(torch.device("cpu"), offline)
    assert default_token_budget("cpu", None, offline) == cpu


@pytest.mark.parametrize(
    ("total_gib", "name", "expected"),
    [(24, "NVIDIA L4", 256), (69.9, None, 256), (80, "NVIDIA H100 80GB HBM3", 1024),
     (141, "NVIDIA H200", 1024), (80, "NVIDIA A100-SXM4-80GB", 256)],
)  # fmt: skip
def test_default_max_num_seqs_is_vllm_s_by_gpu(monkeypatch, tmp_path, total_gib, name, expected):
    """1024 on GPUs of 70 GiB and more, A100s aside, else 256 (and on the CPU), as vLLM; the
    runner's rule and the plan's are one."""
    total = int(total_gib * GiB)
    props = SimpleNamespace(total_memory=total, name=name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert kv_cache.default_max_num_seqs(torch.device("cuda")) == expected
    assert kv_cache.default_max_num_seqs(torch.device("cpu")) == 256
    folder = config_dir(tmp_path, variant_config("llama"))
    configs = build_plan_configs({"model": str(folder)})
    if name is None or "A100" not in name:  # a GPU planned by size has no name
        assert make_plan(*configs, gpu_memory_gib=total_gib).max_num_seqs == expected
    explicit = build_plan_configs({"model": str(folder), "max_num_seqs": 64})
    assert make_plan(*explicit, gpu_memory_gib=total_gib).max_num_seqs == 64


def measured_activation_peak(
    folder: Path, dtype: str, num_tokens: int, num_seqs: int, rows_per_request: int = 1
) -> int:
    """Bytes the profiling pass of gpu/kv_cache.py allocates at its peak, beyond the weights and
    the KV cache, measured on the CPU with torch's memory profiler. The model runs torch's ops,
    as on a GPU: the CPU's native decoder layers work in a scratch buffer of their own."""
    model_config = ModelConfig(
        model=str(folder), load_format="dummy", dtype=dtype, device="cpu", max_model_len=num_tokens,
        cpu_kernels="torch", attention_backend="torch",
    )  # fmt: skip
    runner = ModelRunner(
        ModelRunner.resolve(model_config),
        model_config,
        CacheConfig(kv_cache_memory=0.05),
        SchedulerConfig(max_num_seqs=num_seqs),
    )
    params = kv_cache.profile_sampling_params(runner.sampler.max_logprobs)
    plan = kv_cache.profile_step(num_tokens, num_seqs, runner.block_size, params, rows_per_request)
    runner.kv_caches = runner.kv_layout.allocate(kv_cache.blocks_for(plan))
    with torch.inference_mode():
        runner.execute(plan)  # first-call allocations (lazy buffers) stay out of the peak
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            runner.execute(plan)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak


WIDE = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 704,
        "num_attention_heads": 8, "num_key_value_heads": 2}  # fmt: skip
ATTENTION_HEAVY = {"hidden_size": 256, "intermediate_size": 64, "num_attention_heads": 8,
                   "num_key_value_heads": 8}  # fmt: skip
ACTIVATION_CASES = {
    # name: (config overrides, dtype, tokens, sequences, sampled rows per sequence); the name
    # says which moment peaks
    "mlp": (WIDE, "float32", 1024, 8, 1),
    "mlp-bf16": (WIDE, "bfloat16", 1024, 8, 1),
    "attention": (ATTENTION_HEAVY, "float32", 1024, 64, 1),
    "sampling": (WIDE, "float32", 512, 64, 1),
    "sampling-drafts": (WIDE, "float32", 512, 32, 5),  # 4 speculative tokens each
    # Experts (run expert by expert on the CPU) take less than the sampler here.
    "sampling-experts": ({**WIDE, **ARCH_CONFIG["qwen3_moe"]}, "float32", 512, 64, 1),
}


@pytest.mark.parametrize("case", sorted(ACTIVATION_CASES))
def test_activation_estimate_is_within_ten_percent_of_the_measured_peak(case, tmp_path):
    overrides, dtype, num_tokens, num_seqs, rows = ACTIVATION_CASES[case]
    config_cls, model_cls = ARCHS["qwen3_moe" if "num_experts" in overrides else "llama"]
    config = config_cls(**{**BASE_CONFIG, "max_position_embeddings": 4096, **overrides})
    config.architectures = [model_cls.__name__]
    folder = config_dir(tmp_path, config)
    measured = measured_activation_peak(folder, dtype, num_tokens, num_seqs, rows)
    estimate = estimate_activation_bytes(
        decoder_config(config), num_tokens, num_seqs, DTYPE_BYTES[dtype], device="cpu",
        rows_per_request=rows,
    )  # fmt: skip
    assert estimate == pytest.approx(measured, rel=0.10)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"max_model_len": 10_000}, "max_model_len (10000) is larger"),
        ({"device": "cpu", "gpu_memory": 80}, "does not fit device 'cpu'"),
        ({"gpu_memory": -1}, "gpu_memory must be > 0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
    ],
)
def test_bad_flags_exit_2_with_the_field_named(tmp_path, capsys, flags, message):
    folder = config_dir(tmp_path, variant_config("llama"))
    assert plan_main(str(folder), **flags) == 2
    assert message in capsys.readouterr().err


def test_a_gpu_plan_needs_no_gpu(tmp_path, capsys):
    folder = config_dir(tmp_path, variant_config("qwen2"))
    assert plan_main(str(folder), gpu_memory=24, non_torch_memory=0.25) == 0
    out = capsys.readouterr().out
    assert "device=cuda, dtype=bfloat16" in out
    assert "non-torch 0.25 GiB (assumed)" in out
    assert "max_num_batched_tokens=2048" in out


def local_gpu(monkeypatch, total_gib: float, free_gib: float) -> None:
    """The local GPU as the plan measures it: its total, what is free with this process's CUDA
    context, 0.25 GiB of cuBLAS."""
    target = plan_module.GpuTarget(
        int(total_gib * GiB), GiB // 4, measured=True, free_bytes=int(free_gib * GiB)
    )
    monkeypatch.setattr(plan_module, "_local_gpu", lambda: target)


def test_memory_other_processes_hold_is_outside_the_share(tmp_path, monkeypatch):
    """vLLM's --gpu-memory-utilization: the same KV cache whether the GPU is idle or another
    server holds 9 GiB of it, as long as the share (12 GiB of 24) is free."""
    folder = config_dir(tmp_path, variant_config("qwen2"))
    configs = build_plan_configs({"model": str(folder), "gpu_memory_utilization": 0.5})
    local_gpu(monkeypatch, 24, 23.5)
    idle = make_plan(*configs)
    local_gpu(monkeypatch, 24, 14.5)
    shared = make_plan(*configs)
    assert shared.problem is None and shared.free_bytes == int(14.5 * GiB)
    assert shared.available_kv_bytes == idle.available_kv_bytes
    assert shared.available_kv_bytes == (
        12 * GiB
        - shared.weights_bytes
        - (shared.activation_bytes or 0)
        - shared.graph_pool_bytes
        - GiB // 4
    )


@pytest.mark.parametrize(
    ("flags", "graphs"),
    [({}, True), ({"enforce_eager": True}, False), ({"attention_backend": "torch"}, False)],
)
def test_the_cuda_graph_pool_comes_out_of_the_share(tmp_path, capsys, flags, graphs):
    """As the server's profile sets aside one eager decode at the largest bucket (64 here)."""
    folder = config_dir(tmp_path, variant_config("qwen2"))
    configs = build_plan_configs({"model": str(folder), "max_num_seqs": 70, **flags})
    plan = make_plan(*configs, gpu_memory_gib=24)
    cfg = decoder_config(variant_config("qwen2"))
    expected = plan_module.estimate_graph_pool_bytes(cfg, 64, 2) if graphs else 0
    assert plan.graph_pool_bytes == expected
    assert expected == 0 or expected > 64 * cfg.hidden_size * 2
    assert plan_main(str(folder), gpu_memory=24, max_num_seqs=70, **flags) == 0
    assert f"CUDA graph pool {expected / GiB:.2f} GiB" in capsys.readouterr().out


def test_a_share_that_is_not_free_is_why_serve_would_not_start(tmp_path, monkeypatch, capsys):
    folder = config_dir(tmp_path, variant_config("qwen2"))
    local_gpu(monkeypatch, 24, 11.5)
    assert plan_main(str(folder), gpu_memory_utilization=0.5) == 1
    out = capsys.readouterr().out
    assert (
        "serve would not start: Free memory on device (11.50/24.00 GiB) on startup is less "
        "than desired GPU memory utilization (0.5, 12.00 GiB)"
    ) in out
    assert "total 24.00 GiB x utilization 0.5 = 12.00 GiB" in out
    assert plan_main(str(folder), gpu_memory_utilization=0.45) == 0


@pytest.mark.parametrize("others_gib", [0, 30])
def test_the_profile_sizes_the_kv_cache_from_the_share_not_from_what_others_leave(
    tmp_path, monkeypatch, others_gib
):
    """gpu/kv_cache.py's accounting on a simulated 80 GiB device, with the real profiling pass
    on the CPU: the KV cache is the share (0.5) minus the weights, cuBLAS and the activation
    peak, whatever another process holds."""
    folder = config_dir(tmp_path, variant_config("llama"))
    model_config = ModelConfig(model=str(folder), load_format="dummy", device="cpu",
                               max_model_len=256, cpu_kernels="torch")  # fmt: skip
    runner = ModelRunner(
        ModelRunner.resolve(model_config), model_config, CacheConfig(kv_cache_memory=0.01),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    )  # fmt: skip
    device = FakeDevice(80 * GiB, others_gib * GiB, 3 * GiB, GiB // 4, GiB)
    device.install(monkeypatch)
    start = kv_cache.start_memory(torch.device("cuda"))
    device.load_weights()
    step = kv_cache.profile_step(256, 4, runner.block_size, SamplingParams(temperature=1.0))
    with torch.inference_mode():
        found = kv_cache.profile(
            runner.execute_over, runner.kv_layout, step, 0, 0.5, 3 * GiB, start
        )
    assert device.cache_bytes > 0  # the pass ran with a KV cache of its own
    assert found.available_kv == 40 * GiB - 3 * GiB - GiB // 4 - GiB
    assert found.graph_pool == 0


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_plan_matches_serve_on_cuda():
    """Plan in a process of its own that ends before the server starts: the plan measures the
    memory other processes hold on this GPU, and this test's process must not be one of them."""
    import subprocess
    import sys

    model = "Qwen/Qwen2.5-1.5B-Instruct"
    flags = {"max_model_len": 4096}
    code = (
        "from aioinfer.cli.plan import plan_main; "
        f"plan_main({model!r}, as_json=True, load_format='dummy', **{flags!r})"
    )
    planned = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    plan = SimpleNamespace(**json.loads(planned.stdout))
    port = free_port()
    args = [model, "--load-format", "dummy", "--port", str(port), "--host", "127.0.0.1"]
    proc = ServeProcess([*args, *cli_flags(flags)])
    try:
        proc.wait_ready()
        served = served_numbers(list(proc.lines))
    finally:
        assert proc.stop() == 0
    assert plan.device == "cuda"
    assert_plan_matches(plan, served)
