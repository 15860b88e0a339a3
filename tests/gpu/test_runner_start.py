"""ModelRunner's start-up through the branches only CUDA takes, on the CPU: the memory profile
(a simulated device's counters, the real profiling pass), CUDA graph capture (torch.cuda's graph
API faked) and a capture that fails."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import ScheduledChunk, StepPlan
from aioinfer.gpu import kv_cache
from aioinfer.gpu import runner as runner_module
from aioinfer.gpu.cuda_graphs import CudaGraphRunner, capture_sizes
from aioinfer.gpu.runner import ModelRunner
from aioinfer.model import loader
from aioinfer.model.layers.torch_attention import TorchAttentionBackend
from tests.support.fake_cuda import FakeDevice, GiB
from tests.support.tiny_models import make_variant

MAX_NUM_SEQS = 4
BUDGET = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_variant("llama").save_pretrained(path)
    return path


def build_runner(model_dir: Path, **cache: float) -> ModelRunner:
    model_config = ModelConfig(
        model=str(model_dir), load_format="dummy", dtype="float32", device="cpu",
        max_model_len=128, cpu_kernels="torch", attention_backend="torch", seed=0,
    )  # fmt: skip
    with torch.inference_mode():
        return ModelRunner(
            ModelRunner.resolve(model_config),
            model_config,
            CacheConfig(**cache),
            SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET),
        )


def profile_on_a_fake_device(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    """The runner sizes its KV cache by profiling, on a 2 GiB device whose counters move as the
    weights load."""
    device = FakeDevice(2 * GiB, 0, GiB // 4, GiB // 16, GiB // 8)
    device.install(monkeypatch)
    monkeypatch.setattr(kv_cache, "should_profile", lambda device, cache_config: True)
    load = loader.load_model

    def load_and_count(*args, **kwargs):
        model = load(*args, **kwargs)
        device.load_weights()
        return model

    monkeypatch.setattr(loader, "load_model", load_and_count)
    return device


def run(runner: ModelRunner, plan: StepPlan) -> dict[str, list[int]]:
    with torch.inference_mode():
        return runner.execute(plan).sampled_token_ids


def prefill(n: int) -> StepPlan:
    """n requests of 5 prompt tokens, request r in block r + 1."""
    params = SamplingParams(temperature=0)
    chunks = [
        ScheduledChunk(f"r{r}", (3 + r, 9, 27, 81, 4), 0, (r + 1,), True, params) for r in range(n)
    ]
    return StepPlan(0, tuple(chunks))


def decode(n: int, step: int) -> StepPlan:
    params = SamplingParams(temperature=0)
    chunks = [
        ScheduledChunk(f"r{r}", (7,), 4 + step, (r + 1,), True, params, output_index=step)
        for r in range(n)
    ]
    return StepPlan(step, tuple(chunks))


def test_a_runner_starts_through_the_memory_profile(model_dir, monkeypatch):
    """Every attribute a step reads exists before the profile's forward pass; the KV cache is
    the share (0.5 x 2 GiB) minus the weights, cuBLAS and the activation peak."""
    profile_on_a_fake_device(monkeypatch)
    runner = build_runner(model_dir, gpu_memory_utilization=0.5)
    found = runner.memory_profile
    assert found is not None and found.graph_pool == 0  # no graphs on this device
    assert found.activations == GiB // 8
    expected = GiB - GiB // 4 - GiB // 16 - GiB // 8
    assert runner.info.available_kv_gib * GiB == expected
    assert runner.info.num_blocks == expected // runner.kv_layout.bytes_per_block
    assert runner.kv_caches[0].shape[0] == runner.info.num_blocks
    assert set(run(runner, prefill(2))) == {"r0", "r1"}
    runner.close()


def test_the_profile_step_is_the_heaviest_the_engine_admits():
    """The full token budget over max_num_seqs requests, each sampling with top-k, top-p,
    penalties (its history set) and the most logprobs; blocks numbered from 1."""
    params = kv_cache.profile_sampling_params(20)
    plan = kv_cache.profile_step(1000, 64, 16, params, sampled_rows_per_request=3)
    assert plan.num_tokens == 1000 and len(plan.chunks) == 64
    first = plan.chunks[0]
    assert first.sample and first.history == first.token_ids and first.prompt_len == 15
    assert len(first.draft_token_ids) == 2
    assert first.sampling_params.has_penalties and first.sampling_params.logprobs == 20
    tables = [b for c in plan.chunks for b in c.block_table]
    assert sorted(tables) == list(range(1, len(tables) + 1))
    assert kv_cache.blocks_for(plan) == len(tables) + 1
    pooled = kv_cache.profile_step(100, 8, 16, None, pooling="MEAN")
    assert not any(c.sample or c.history for c in pooled.chunks)


class FakeGraph:
    """torch.cuda.CUDAGraph's surface: a capture runs the forward eagerly, a replay counts."""

    def __init__(self) -> None:
        self.replayed = 0

    def pool(self) -> str:
        return "pool"

    def replay(self) -> None:
        self.replayed += 1


class PaddingTolerantBackend(TorchAttentionBackend):
    """The torch reference backend, with padding rows (slot -1, which graph-safe backends skip)
    written into the null block 0, which no request reads."""

    def forward(self, query, key, value, kv_cache, metadata, *args):
        slots = metadata.slot_mapping.clamp(min=0)
        return super().forward(
            query, key, value, kv_cache, replace(metadata, slot_mapping=slots), *args
        )


def fake_graph_api(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fake torch.cuda's graph API; returns the capture_error_mode of each capture."""
    modes: list[str] = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, capture_error_mode="global"):
        modes.append(capture_error_mode)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(runner_module, "graphs_off_reason", lambda *args: None)
    backend = PaddingTolerantBackend()
    monkeypatch.setattr(runner_module, "select_attention_backend", lambda *args: backend)
    return modes


def test_graphs_are_captured_thread_local_and_replays_are_counted(model_dir, monkeypatch):
    """Each bucket is captured with capture_error_mode="thread_local" (the tokenizer loads on
    another thread while the engine starts); decode steps that fit a bucket replay it."""
    profile_on_a_fake_device(monkeypatch)
    modes = fake_graph_api(monkeypatch)
    runner = build_runner(model_dir, gpu_memory_utilization=0.5)
    assert modes == ["thread_local"] * len(capture_sizes(MAX_NUM_SEQS))
    assert runner.info.graphs_off_reason is None and runner.info.graph_capture_seconds
    assert runner.memory_profile is not None and runner.memory_profile.graph_pool > 0
    assert runner.graph_replays == 0
    run(runner, prefill(3))  # a prefill runs eagerly
    assert runner.graph_replays == 0
    for step in range(1, 4):
        run(runner, decode(3, step))
    assert runner.graph_replays == 3
    assert runner.graph_runner is not None
    assert runner.graph_runner.graphs[4].replayed == 3  # 3 requests pad to the bucket of 4
    runner.close()


def test_a_failed_capture_leaves_an_engine_that_runs_eagerly(model_dir, monkeypatch):
    fake_graph_api(monkeypatch)
    for name in ("synchronize", "empty_cache", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: (0, 0))

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CudaGraphRunner, "capture", fail)
    runner = build_runner(model_dir, kv_cache_memory=0.01)
    reason = runner.info.graphs_off_reason
    assert reason is not None and reason.startswith("capture failed: RuntimeError(")
    assert "stream is capturing" in reason
    assert runner.graph_runner is None and runner.info.graph_capture_seconds is None
    first = run(runner, prefill(2))
    second = run(runner, decode(2, 1))
    assert set(first) == set(second) == {"r0", "r1"}
    assert runner.graph_replays == 0
    runner.close()
