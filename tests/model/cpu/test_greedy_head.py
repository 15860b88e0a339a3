"""The exact greedy LM head (model/cpu/greedy_head.py): each row's argmax of the float32
logits, found through a bfloat16 screen, must be the index that `packed_linear` and
`max(dim).indices` give, bit for bit and ties included; the screen must stay within the error
bound the kernel relies on; rows the bound cannot settle must come back as None.

Skipped where the CPU lacks AVX512-BF16 (or the native kernels do not build)."""

from __future__ import annotations

import math

import pytest
import torch

from aioinfer import SamplingParams
from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.cpu import packed_weights
from aioinfer.model.cpu.greedy_head import MAX_STRIPS, ROWS, GreedyHead
from aioinfer.offline.llm import LLM
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer


@pytest.fixture(scope="module")
def kernels() -> cpu_native.NativeKernels:
    built = cpu_native.load()
    if built is None:
        pytest.skip(cpu_native.unavailable_reason())
    if not built.has_greedy_head:
        pytest.skip("this CPU has no AVX512-BF16")
    return built


def screen_of(packed: torch.Tensor, kernels: cpu_native.NativeKernels) -> GreedyHead:
    head = GreedyHead.build(packed, kernels)
    assert head is not None
    return head


def full_head_argmax(
    kernels: cpu_native.NativeKernels, x: torch.Tensor, packed: torch.Tensor
) -> torch.Tensor:
    return kernels.packed_linear(x, packed, None).max(dim=-1).indices


def error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's bound on |screened - float32| per logit [M, V], as its comment derives."""
    k = x.shape[1]
    u, gamma = 2.0**-8, k * 2.0**-23 / (1 - k * 2.0**-23)
    rel = (2 * u + u * u + gamma * ((1 + u) ** 2 + 1)) * 1.01
    xd, norms = x.double(), weight.double().norm(dim=1)
    floor = 2.0**-126 * (xd.abs().sum(1, keepdim=True) + math.sqrt(k) * norms.max() + 2 * k)
    return rel * xd.norm(dim=1, keepdim=True) * norms + floor * 1.01


@pytest.mark.parametrize("case", range(20))
def test_matches_the_float32_head_and_stays_within_its_bound(
    kernels: cpu_native.NativeKernels, case: int
) -> None:
    gen = torch.Generator().manual_seed(case)
    k = (32, 48, 96, 576, 80, 64)[case % 6]  # AMX screens where K % 32 == 0, if the CPU has it
    v = 32 * int(torch.randint(1, 60, (1,), generator=gen))
    m = (1, 2, 13, 14, 15, 16, 31, 64, 65, 150)[case % 10]  # 15, 16: one transposed tile
    weight = torch.randn(v, k, generator=gen) * (0.02, 1.0, 30.0)[case % 3]
    x = torch.randn(m, k, generator=gen) * (1e-3, 1.0, 1e4)[case % 3]
    packed = packed_weights.pack_weight(weight)
    head = screen_of(packed, kernels)
    got = head(x)
    assert got is not None
    assert torch.equal(got, full_head_argmax(kernels, x, packed))
    last = x[(m - 1) // ROWS * ROWS :]  # the scratch holds the last block's screen
    exact = kernels.packed_linear(last, packed, None).double()
    error = (head.screened_logits(last.shape[0]).double() - exact).abs()
    assert bool((error <= error_bound(last, weight)).all())


def test_ties_and_near_ties_go_to_the_first_index(kernels: cpu_native.NativeKernels) -> None:
    """Rows equal to each other (far apart, in different strips) or a few ulps apart, which
    bfloat16 cannot tell apart: float32 decides, and an exact tie goes to the lower index."""
    gen = torch.Generator().manual_seed(0)
    v, k = 2048, 128
    weight = torch.randn(v, k, generator=gen)
    weight[1500] = weight[37]  # an exact tie across strips
    weight[900] = weight[37] * (1 + 2e-7)  # within bfloat16's blur, but larger in float32
    weight[901] = weight[37] * (1 - 2e-7)
    packed = packed_weights.pack_weight(weight)
    head = screen_of(packed, kernels)
    x = torch.stack([weight[37], -weight[37], weight[1500] * 3, torch.randn(k, generator=gen)])
    got = head(x)
    expected = full_head_argmax(kernels, x, packed)
    assert got is not None and torch.equal(got, expected)
    assert expected[0] == 900  # the slightly larger copy, which the screen alone cannot see

    weight[900] = weight[901] = weight[37]  # now three exact copies and one more: 37 wins
    packed = packed_weights.pack_weight(weight)
    got = screen_of(packed, kernels)(x[:1])
    assert got is not None and got.tolist() == [37]
    assert full_head_argmax(kernels, x[:1], packed).tolist() == [37]


def test_float32_overrules_the_screens_own_maximum(kernels: cpu_native.NativeKernels) -> None:
    """Row 3 rounds down in bfloat16 (1.0035 -> 1.0) and loses the screen to row 700, yet its
    float32 logit is the larger: the bound must keep it."""
    weight = torch.randn(1024, 32, generator=torch.Generator().manual_seed(2)) * 1e-3
    weight[3, :2] = torch.tensor([1.0035, 0.0])
    weight[700, :2] = torch.tensor([1.0, 0.002])
    packed = packed_weights.pack_weight(weight)
    head = screen_of(packed, kernels)
    x = torch.zeros(1, 32)
    x[0, :2] = 1.0
    got = head(x)
    assert int(head.screened_logits(1).argmax()) == 700
    assert got is not None and got.tolist() == [3] == full_head_argmax(kernels, x, packed).tolist()


def test_rows_it_cannot_settle_come_back_as_none(kernels: cpu_native.NativeKernels) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64 * (MAX_STRIPS + 8), 64, generator=gen)
    head = screen_of(packed_weights.pack_weight(weight), kernels)
    assert head(torch.randn(3, 64, generator=gen)) is not None
    # Every logit 0: all strips are within reach of the max.
    assert head(torch.zeros(1, 64)) is None
    for bad in (float("nan"), float("inf"), 1e38):
        x = torch.randn(2, 64, generator=gen)
        x[1, 5] = bad
        assert head(x) is None
    # One row too hard fails the call (the caller takes the full head for all rows).
    assert head(torch.cat([torch.randn(2, 64, generator=gen), torch.zeros(1, 64)])) is None


def test_logits_near_the_float_range_take_the_full_head(
    kernels: cpu_native.NativeKernels,
) -> None:
    """Where float32's chain of sums can overflow, the screen (which adds in another order)
    cannot bound it: column 0 is inf in float32 (2^127 + 2^127) but finite in the screen, below
    column 20. And a row norm beyond float32 (entries of 9e37) must not turn the margin NaN."""
    x = torch.full((1, 4), 2.0**63)
    weight = torch.zeros(32, 4)
    weight[0] = torch.tensor([2.0**64, 0, 2.0**64, -(2.0**64)])
    weight[20, 0] = 1.75 * 2.0**64
    packed = packed_weights.pack_weight(weight)
    assert full_head_argmax(kernels, x, packed).tolist() == [0]
    assert screen_of(packed, kernels)(x) is None

    weight = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    weight[:16] = 9e37
    packed = packed_weights.pack_weight(weight)
    head = screen_of(packed, kernels)
    assert head(torch.zeros(1, 16)) is None
    assert head(torch.full((1, 16), 1e-20)) is None


def test_heads_it_cannot_screen_are_refused(kernels: cpu_native.NativeKernels) -> None:
    weight = torch.randn(64, 32)
    assert GreedyHead.build(packed_weights.pack_weight(weight), kernels) is not None
    assert (
        GreedyHead.build(packed_weights.pack_weight(torch.randn(48, 32)), kernels) is None
    )  # 3 strips
    assert (
        GreedyHead.build(packed_weights.pack_weight(torch.randn(64, 34)[:, :33]), kernels) is None
    )
    weight[3, 4] = 3e38  # becomes inf in bfloat16
    assert GreedyHead.build(packed_weights.pack_weight(weight), kernels) is None
    avx2 = cpu_native.load("haswell")
    if avx2 is not None:
        assert not avx2.has_greedy_head


def test_an_engine_uses_it_for_greedy_rows_with_the_same_tokens(
    kernels: cpu_native.NativeKernels, tmp_path
) -> None:
    """Greedy requests take the screen and produce the tokens of the full head; requests with
    logprobs or a temperature take the full head."""
    make_variant("llama").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=0.01, max_model_len=128)
    try:
        model = llm.engine.gpu.runner.model
        greedy = model.lm_head.greedy
        assert greedy is not None
        calls = []
        model.lm_head.greedy = lambda x: calls.append(x.shape[0]) or greedy(x)
        prompts = [[5 + i, 17, 300 + i, 42] for i in range(6)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        screened = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert sum(calls) >= 6 * 12
        model.lm_head.greedy = None
        full = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert screened == full

        model.lm_head.greedy = lambda x: calls.append(-1) or greedy(x)
        calls.clear()
        llm.generate(prompts[:2], params.clone(logprobs=2))
        llm.generate(prompts[:2], params.clone(temperature=0.8, seed=1))
        assert calls == []
    finally:
        llm.shutdown()


def test_gemma_2_with_capped_logits_takes_the_full_head(
    kernels: cpu_native.NativeKernels, tmp_path
) -> None:
    """cap * tanh(logit / cap) can round neighbouring logits to one float: the first maximum
    of the capped logits is not always the raw logits' argmax."""
    hf = make_variant("gemma2")
    assert hf.config.final_logit_softcapping
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=0.01, max_model_len=64)
    try:
        model = llm.engine.gpu.runner.model
        assert model.lm_head.greedy is not None
        assert model.greedy_token_ids(torch.randn(2, hf.config.hidden_size)) is None
        model.hf_config.final_logit_softcapping = None
        assert model.greedy_token_ids(torch.randn(2, hf.config.hidden_size)) is not None
    finally:
        llm.shutdown()
