"""tests/support/parity.py on the CPU: the logits comparison on synthetic logits, and the
teacher-forced runs on a tiny float32 model: eager, the triton kernels under TRITON_INTERPRET=1
against the torch backend, and the graph path through CudaGraphRunner.replay with each graph
standing in as its forward run eagerly (capturing needs CUDA)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.gpu.cuda_graphs import CudaGraphRunner
from tests.support.parity import (
    ParityReport,
    assert_parity,
    block_tables,
    compare_logits,
    teacher_forced,
)

STEPS, BATCH, VOCAB = 6, 8, 4096


def synthetic_logits(seed: int = 0) -> torch.Tensor:
    """[STEPS, BATCH, VOCAB] logits spread like a random-weight model's (std ~0.8)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, BATCH, VOCAB, generator=gen) * 0.8


def with_gap(logits: torch.Tensor, step: int, row: int, gap: float) -> tuple[int, int]:
    """Make the row's best two logits `gap` apart (gap: of the scale); their token ids."""
    values = logits[step, row]
    top2 = values.topk(2).indices.tolist()
    scale = float(logits.abs().max())
    values[top2[1]] = values[top2[0]] - gap * scale
    return top2[0], top2[1]


def test_identical_logits_pass() -> None:
    ref = synthetic_logits()
    report = compare_logits(ref, ref.clone())
    assert report.rows == STEPS * BATCH
    assert report.max_abs_diff == 0 and report.top1_agreement == 1.0
    assert report.tie_flips == report.real_flips == 0 and report.near_tie_fraction == 1.0
    assert_parity(report)
    # A sequence of per-step [B, V] tensors is the same as their stack.
    assert compare_logits(list(ref), list(ref)) == report


def test_near_tie_flip_passes() -> None:
    ref = synthetic_logits(1)
    best, second = with_gap(ref, 2, 5, 0.004)
    out = ref.clone()
    out[2, 5, second] = ref[2, 5, best] + 0.002 * float(ref.abs().max())  # swapped by a hair
    report = compare_logits(ref, out)
    assert report.tie_flips == 1 and report.real_flips == 0
    assert report.top1_agreement == pytest.approx(1 - 1 / (STEPS * BATCH))
    assert report.worst_flip_gap == pytest.approx(0.004, rel=1e-3)
    assert_parity(report)


def test_real_disagreement_fails() -> None:
    ref = synthetic_logits(2)
    out = ref.clone()
    # The other run picks the token the reference rates lowest.
    scale = float(ref.abs().max())
    worst = int(ref[0, 3].argmin())
    out[0, 3, worst] = ref[0, 3].max() + 0.1 * scale
    report = compare_logits(ref, out)
    assert report.real_flips == 1 and report.real_flip_rows == (3,)
    with pytest.raises(AssertionError, match="beyond the tie tolerance"):
        assert_parity(report)


def test_flip_beyond_the_tie_tolerance_fails_with_small_differences() -> None:
    # Every logit within 2.5 % of the scale, but the pick flips across a 4 % gap: no
    # rounding turns that around, although the largest difference alone would pass.
    ref = synthetic_logits(3)
    best, second = with_gap(ref, 4, 0, 0.04)
    scale = float(ref.abs().max())
    out = ref.clone()
    out[4, 0, best] -= 0.025 * scale
    out[4, 0, second] += 0.025 * scale
    report = compare_logits(ref, out)
    assert report.rel_diff == pytest.approx(0.025, rel=1e-3)
    assert report.real_flips == 1
    with pytest.raises(AssertionError, match="beyond the tie tolerance"):
        assert_parity(report)


def test_unrelated_logits_fail() -> None:
    ref = synthetic_logits(4)
    report = compare_logits(ref, synthetic_logits(5))
    assert report.top1_agreement < 0.1
    with pytest.raises(AssertionError, match=r"max \|diff\| above"):
        assert_parity(report)


def test_bfloat16_noise_passes() -> None:
    # Two runs that each round differently: relative noise of a few bfloat16 ulps, then the
    # logits themselves rounded to bfloat16, as compute_logits returns them.
    ref = synthetic_logits(6)
    gen = torch.Generator().manual_seed(7)
    noise = torch.randn(ref.shape, generator=gen) * 2.0**-8
    out = (ref * (1 + noise)).bfloat16().float()
    report = compare_logits(ref.bfloat16().float(), out)
    assert 0 < report.rel_diff < 0.02
    assert report.real_flips == 0
    assert_parity(report)


def test_nan_fails_and_shapes_must_match() -> None:
    ref = synthetic_logits(8)
    out = ref.clone()
    out[1, 1, 17] = float("nan")
    report = compare_logits(ref, out)
    assert report.real_flips == 1
    with pytest.raises(AssertionError, match=r"max \|diff\| above"):
        assert_parity(report)
    with pytest.raises(ValueError, match="same shape"):
        compare_logits(ref, ref[:, :, :-1])


def test_report_reads() -> None:
    report = ParityReport(
        rows=10, scale=4.0, max_abs_diff=0.1, top1_agreement=0.8, tie_flips=1, real_flips=1,
        worst_flip_gap=0.05, tie_rtol=0.03, real_flip_rows=(7,),
    )  # fmt: skip
    assert report.rel_diff == pytest.approx(0.025)
    assert report.near_tie_fraction == 0.5
    assert "rows [7]" in str(report)


def test_block_tables_skip_the_null_block_and_shuffle() -> None:
    tables = block_tables([5, 16, 17, 1], block_size=4, num_blocks=20, seed=3)
    assert [len(t) for t in tables] == [2, 4, 5, 1]
    used = [b for t in tables for b in t]
    assert len(set(used)) == len(used) and 0 not in used and max(used) < 20
    assert used != sorted(used)
    with pytest.raises(ValueError, match="blocks needed"):
        block_tables([100], block_size=4, num_blocks=20)


# --- teacher-forced runs on a tiny model -----------------------------------------------------

PROMPTS = [[5 + i] * (3 + 7 * i) for i in range(5)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.support.tiny_models import make_variant
    from tests.support.tokenizers import make_tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_variant("qwen2").save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return str(folder)


def cpu_llm(folder: str, backend: str) -> LLM:
    return LLM(
        folder, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory=0.01,
        attention_backend=backend, cpu_kernels="torch",
    )  # fmt: skip


@pytest.fixture(scope="module")
def torch_llm(tiny_folder: str) -> Iterator[LLM]:
    with cpu_llm(tiny_folder, "torch") as llm:
        yield llm


def test_teacher_forced_follows_greedy_generation(torch_llm: LLM) -> None:
    steps = 10
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    outs = torch_llm.generate(PROMPTS, params, use_tqdm=False)
    gpu = torch_llm.engine.gpu
    run = gpu.call(lambda: teacher_forced(gpu.runner, PROMPTS, steps)).result()
    assert len(run.decode["eager"]) == steps and run.prefill.shape == (len(PROMPTS), 512)
    # The tokens fed are the run's own argmax: the engine's greedy tokens, step for step.
    picked = [step.argmax(-1).tolist() for step in run.logits()]
    assert [list(t) for t in zip(*picked, strict=True)] == [o.outputs[0].token_ids for o in outs]
    assert run.tokens == picked[:-1]

    # Forced with those tokens (over other blocks: another seed), the logits come back exactly.
    again = gpu.call(
        lambda: teacher_forced(gpu.runner, PROMPTS, steps, forced=run.tokens, seed=1)
    ).result()
    report = compare_logits(run.logits(), again.logits())
    assert report.max_abs_diff == 0 and report.top1_agreement == 1.0

    # A graph replay needs CUDA graphs; each path runs once a step.
    with pytest.raises(ValueError, match="graph replay"):
        gpu.call(lambda: teacher_forced(gpu.runner, PROMPTS, 2, paths=("eager", "graph"))).result()
    for paths in [("compiled",), ("eager", "eager"), ()]:
        with pytest.raises(ValueError, match="paths"):
            gpu.call(lambda p=paths: teacher_forced(gpu.runner, PROMPTS, 2, paths=p)).result()


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the triton kernels on the CPU need it"
)


@needs_interpreter
def test_triton_backend_teacher_forced_matches_torch(tiny_folder: str, torch_llm: LLM) -> None:
    # What tests/gpu/test_bf16_parity.py checks in bfloat16 on CUDA, here interpreted in float32.
    prompts, steps = PROMPTS[:3], 3
    gpu = torch_llm.engine.gpu
    ref = gpu.call(lambda: teacher_forced(gpu.runner, prompts, steps)).result()
    with cpu_llm(tiny_folder, "triton") as llm:
        other = llm.engine.gpu
        assert other.call(lambda: other.runner.attn_backend.name).result() == "triton"
        out = other.call(
            lambda: teacher_forced(other.runner, prompts, steps, forced=ref.tokens)
        ).result()
    report = compare_logits(ref.logits(), out.logits())
    assert_parity(report, max_rel_diff=1e-5, min_top1=1.0)


class EagerGraph:
    """Stands in for the captured graph of one bucket: replay() runs its forward eagerly, from
    the graph runner's static buffers, into its output."""

    def __init__(self, graphs: CudaGraphRunner, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size] = self.graphs._forward(self.size)


@needs_interpreter
def test_graph_path_pads_to_the_bucket(tiny_folder: str) -> None:
    # The graph path of tests/gpu/test_bf16_parity.py: 5 requests through the bucket of 8, its
    # padding rows writing nowhere and attending to nothing, against the eager path. The triton
    # backend: a graph's attention reads lengths from the device, never from the host.
    prompts, steps = PROMPTS, 4

    def run(runner: Any) -> Any:
        graphs = CudaGraphRunner(
            runner.model, runner.kv_caches, runner.attn_backend, 8, 8, 128, torch.device("cpu")
        )
        assert graphs.sizes == [1, 2, 4, 8]
        graphs.graphs = {size: EagerGraph(graphs, size) for size in graphs.sizes}
        runner.graph_runner = graphs
        try:
            return teacher_forced(runner, prompts, steps, paths=("eager", "graph"))
        finally:
            runner.graph_runner = None

    with cpu_llm(tiny_folder, "triton") as llm:
        gpu = llm.engine.gpu
        forced = gpu.call(lambda: run(gpu.runner)).result()
    assert len(forced.decode["graph"]) == steps
    report = compare_logits(forced.decode["eager"], forced.decode["graph"])
    assert_parity(report, max_rel_diff=1e-5, min_top1=1.0)
