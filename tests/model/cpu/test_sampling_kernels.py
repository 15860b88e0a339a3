"""The sampler's native CPU kernels (model/cpu/kernels.c): top_p thresholds against a sort, the
exponential race against a float64 reimplementation of its hash, and allowed-token masks
against the torch bias, on both builds.

Skipped, with the reason, where they cannot build (no AVX2 + FMA, no C compiler)."""

from __future__ import annotations

import math

import pytest
import torch

from aioinfer.gpu.token_masks import mask_bias
from aioinfer.model.cpu import kernels as cpu_native


def sorted_top_p_thresholds(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The sampler's reference: sort, cumulative probability before each token, the last
    token whose predecessors hold less than top_p."""
    ordered = logits.sort(dim=-1, descending=True).values
    probs = ordered.double().softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    last = ((before < top_p).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    return ordered.gather(1, last).masked_fill_(top_p >= 1.0, float("-inf"))


@pytest.mark.parametrize("case", range(40))
def test_top_p_thresholds_match_a_sort(kernels: cpu_native.NativeKernels, case: int) -> None:
    """Ties, removed (-inf) tokens, widths off the vector size, top_p of 0 and 1."""
    gen = torch.Generator().manual_seed(case)
    rows, vocab = 1 + case % 5, int(torch.randint(1, 700, (1,), generator=gen))
    logits = torch.randn(rows, vocab, generator=gen) * (0.1 + case % 7)
    if case % 2:
        logits = logits.round()  # many ties
    if case % 3 == 0:
        logits[torch.rand(rows, vocab, generator=gen) < 0.4] = float("-inf")
    top_p = torch.rand(rows, 1, generator=gen)
    top_p[0] = (0.0, 1.0, float(top_p[0]))[case % 3]
    got = kernels.top_p_thresholds(logits, top_p)
    expected = sorted_top_p_thresholds(logits, top_p)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The kept set never includes a removed token, and holds at least top_p of the mass.
    kept = logits >= got
    kept_removed = (kept & torch.isinf(logits)).any(dim=-1, keepdim=True)
    assert not (kept_removed & (got > float("-inf"))).any()  # only where top_p keeps all
    mass = (logits.double().softmax(-1) * kept).sum(-1, keepdim=True)
    assert bool((mass >= top_p.double() - 1e-9).all())


def test_top_p_thresholds_of_a_full_vocabulary(kernels: cpu_native.NativeKernels) -> None:
    """SmolLM2's 49152 logits, flat and peaked rows (the flattest puts thousands of distinct
    logits in one bucket): the nucleus of a sort, in double."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([[0.5], [1], [2], [4], [8], [16], [1e-3]])
    logits = torch.randn(7, 49152, generator=gen) * scales
    top_p = torch.tensor([[0.9], [0.5], [0.95], [0.3], [0.99], [0.7], [0.6]])
    got = kernels.top_p_thresholds(logits, top_p)
    torch.testing.assert_close(got, sorted_top_p_thresholds(logits, top_p), rtol=0, atol=0)


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = x * 0x7FEB352D & 0xFFFFFFFF
    x ^= x >> 15
    x = x * 0x846CA68B & 0xFFFFFFFF
    return x ^ x >> 16


def reference_race(logits: torch.Tensor, keys: list[int]) -> list[int]:
    """The race in float64 with the kernel's noise: E_i = -log((k + 1/2) / 2^23), k the top 23
    bits of two mixer rounds over (key, i); the first index of the largest exp(l - max) / E."""
    winners = []
    for row, key in zip(logits.double().tolist(), keys, strict=True):
        lo, hi = key & 0xFFFFFFFF, key >> 32 & 0xFFFFFFFF
        top = max(x for x in row if x == x)  # NaN never the max
        scores = []
        for i, x in enumerate(row):
            h = _mix32((_mix32(i ^ lo) + hi) & 0xFFFFFFFF)
            noise = -math.log(((h >> 9) + 0.5) / 2**23)
            scores.append(math.exp(x - top) / noise if x > -math.inf else -1.0)
        winners.append(max(range(len(row)), key=lambda i: (scores[i], -i)))
    return winners


@pytest.mark.parametrize("vocab", [1, 15, 16, 33, 500])
def test_race_argmax_is_the_race_of_its_hash(kernels: cpu_native.NativeKernels, vocab: int) -> None:
    """Every row, vector lanes and the padded tail alike, removed tokens never drawn; keys past
    2^63 (two's complement on the way to C)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * 3
    logits[torch.rand(6, vocab, generator=gen) < 0.3] = float("-inf")
    logits[:, 0] = torch.where(torch.isinf(logits[:, 0]), 0.0, logits[:, 0])  # one left per row
    keys = [0, 1, 2**32 + 7, 2**63 + 5, 2**64 - 1, 0x1234_5678_9ABC_DEF0]
    got = kernels.race_argmax(logits, keys).tolist()
    assert got == reference_race(logits, keys)
    assert all(logits[r, i] > -math.inf for r, i in enumerate(got))


@pytest.mark.parametrize("vocab", [40, 500, 49152])
def test_race_argmax_over_a_truncated_row(kernels: cpu_native.NativeKernels, vocab: int) -> None:
    """A nucleus left by top_p / top_k: whole vectors removed, which the kernel skips, the kept
    tokens anywhere (first lane, last, the padded tail), a NaN among removed tokens; a row with
    every token removed draws index 0."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.full((5, vocab), float("-inf"))
    for row in range(4):
        kept = torch.randperm(vocab, generator=gen)[: 1 + row * 3]
        logits[row, kept] = torch.randn(len(kept), generator=gen)
    logits[1, vocab - 1] = 0.5  # in the tail when vocab is not a multiple of the lanes
    logits[2, 16] = float("nan")
    keys = [3, 2**40 + 1, 99, 2**64 - 7, 5]
    got = kernels.race_argmax(logits, keys).tolist()
    assert got[:4] == reference_race(logits[:4], keys[:4])
    assert got[4] == 0
    assert all(logits[r, i] > -math.inf for r, i in enumerate(got[:4]))


def test_race_argmax_draws_from_the_softmax(kernels: cpu_native.NativeKernels) -> None:
    """Frequencies over many keys follow softmax(logits); a removed token is never drawn."""
    logits = torch.tensor([1.0, 0.4, 0.2, -0.3, float("-inf"), -1.2])
    n = 40_000
    drawn = kernels.race_argmax(logits.expand(n, -1), list(range(n)))
    counts = torch.bincount(drawn, minlength=6).double()
    probs = logits.double().softmax(-1)
    assert counts[4] == 0
    kept = probs > 0
    chi_square = float(((counts[kept] - n * probs[kept]) ** 2 / (n * probs[kept])).sum())
    assert chi_square < 30.0  # 4 degrees of freedom: p < 1e-5


def test_top_p_thresholds_survive_nan_and_inf(kernels: cpu_native.NativeKernels) -> None:
    """A broken model's NaN or infinite logits give some threshold, never a crash or a write
    out of bounds (NaN once replaced the row's max, and the bucket index went negative)."""
    for bad in (float("nan"), float("inf")):
        logits = torch.full((3, 48), -10.0)
        logits[:, 0], logits[:, 32] = 5.0, 1.0
        logits[0, 16], logits[1, 47], logits[2] = bad, bad, bad
        got = kernels.top_p_thresholds(logits, torch.full((3, 1), 0.9))
        assert got.shape == (3, 1)
    logits = torch.full((1, 48), -10.0)
    logits[0, 0], logits[0, 16], logits[0, 32] = 5.0, float("nan"), 1.0
    # The NaN does not hide the max: the nucleus of [5, 1, -10...] at 0.9 is {5} alone.
    assert float(kernels.top_p_thresholds(logits, torch.tensor([[0.9]]))) == 5.0


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 70, 49152])
def test_apply_token_bitmask_matches_the_torch_bias(
    kernels: cpu_native.NativeKernels, vocab: int
) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    logits[0, 0] = float("-inf")  # already removed: stays removed
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)
    words = (vocab + 31) // 32
    masks = torch.randint(-(2**31), 2**31, (3, words), generator=gen, dtype=torch.int64)
    masks = masks.to(torch.int32)
    masks[1, 0] = -1  # every token of a word allowed
    masks[2] = 0  # nothing allowed
    expected = logits.clone()
    expected.index_add_(0, rows, mask_bias(masks, vocab))
    got = logits.clone()
    kernels.apply_token_bitmask(got, rows, masks)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="masks must be int32"):
        kernels.apply_token_bitmask(got, rows, masks[:2])
