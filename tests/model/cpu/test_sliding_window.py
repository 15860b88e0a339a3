"""Sliding-window attention (a query at position p attends to keys p - window + 1 .. p only)
and soft-capped scores (softcap * tanh(score / softcap), Gemma 2).

The native kernels and the torch reference backend against a float64 brute force that masks
and caps the scores explicitly; windows smaller and larger than a block, a chunk of keys and
the contexts, on caches whose unused slots hold NaN."""

from __future__ import annotations

import itertools

import pytest
import torch

from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.layers.torch_attention import decode_attention, prefill_attention
from tests.model.cpu.test_kernels import causal_chunk_attention, random_paged_case

# (window, softcap): windows shorter and longer than a block and a chunk of keys; caps alone and
# with a window.
CASES = [(1, 0.0), (5, 0.0), (16, 0.0), (40, 0.0), (100, 0.0), (0, 2.0), (16, 2.0)]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("window", "softcap"), CASES)
@pytest.mark.parametrize("many", [False, True])
def test_decode_sees_only_the_window(
    kernels: cpu_native.NativeKernels, block_size: int, window: int, many: bool, softcap: float
) -> None:
    # Contexts shorter than, equal to and longer than the window; `many`: a work item per
    # request, else one request split by KV head.
    w = window or 30
    seq_lens = [3, w, w + 1, 5 * w + 3, 77, 250] if many else [4 * w + 9]
    query, cache, tables, lens = random_paged_case(window + many, block_size, 64, 3, seq_lens)
    scale = 0.25
    expected = causal_chunk_attention(
        query, cache, tables, [1] * len(seq_lens), seq_lens, scale, window, softcap
    )
    got = kernels.paged_decode_attention(query, cache, tables, lens, scale, window, softcap)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    reference = decode_attention(
        query, cache, tables, lens, max(seq_lens), scale, window=window, softcap=softcap
    )
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    # The window and the cap matter here: without them the answer differs.
    if window or softcap:
        plain = kernels.paged_decode_attention(query, cache, tables, lens, scale)
        assert not torch.allclose(plain, got, atol=1e-3)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("window", "softcap"), CASES)
@pytest.mark.parametrize("gqa", [1, 3])
def test_prefill_sees_only_the_window(
    kernels: cpu_native.NativeKernels, block_size: int, window: int, gqa: int, softcap: float
) -> None:
    """Fresh prompts and chunks after cached prefixes, one token to several work items."""
    query_lens = [1, 7, 150, 2 * block_size + 3, 64]
    before = [0, 3 * block_size + 1, 0, block_size, 70]
    seq_lens = [q + b for q, b in zip(query_lens, before, strict=True)]
    seed = block_size * 7 + window + gqa
    _, cache, tables, lens = random_paged_case(seed, block_size, 64, gqa, seq_lens)
    query = torch.randn(sum(query_lens), 2 * gqa, 64, generator=torch.Generator().manual_seed(seed))
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    scale = 0.25
    expected = causal_chunk_attention(
        query, cache, tables, query_lens, seq_lens, scale, window, softcap
    )
    got = kernels.paged_prefill_attention(
        query, cache, tables, starts, lens, scale, window, softcap
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for i, (start, seq_len) in enumerate(zip(starts.tolist(), seq_lens, strict=False)):
        rows = slice(start, start + query_lens[i])
        reference = prefill_attention(
            query[rows], cache, tables[i], seq_len, scale, window, softcap
        )
        torch.testing.assert_close(reference, expected[rows], rtol=1e-5, atol=1e-5)
