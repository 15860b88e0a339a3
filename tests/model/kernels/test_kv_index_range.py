"""The triton kernels on a KV cache of more than 2^31 elements, at its top blocks.

At 0.92 of an H200 each layer's cache of Qwen2.5-1.5B is about 281k blocks of 8192 elements,
2.3e9 in all: an element offset computed in int32 overflows from block 262144 on. The kernels
compute their offsets in int64; these tests check the values read and written there, not only
that nothing crashes.

One bfloat16 cache of Qwen2.5-1.5B's layout (2 KV heads of 128, blocks of 16) with 4096 blocks
more than 2^31 elements hold (4.1 GiB), NaN wherever nothing was written. The requests' blocks
are the cache's last ones in shuffled order (the very last one filled), every one past 2^31
elements; one request takes every other block from the bottom of the cache instead. The torch
reference runs on a small cache of just those blocks (the block tables renumbered), so it
needs no second copy, and nothing here but the kernels indexes the large cache: its blocks are
read and written through slices.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.gpu
# Skip before importing the kernels (see test_triton_gpu.py).
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from aioinfer.model.kernels.paged_decode import paged_decode_attention  # noqa: E402
from aioinfer.model.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from aioinfer.model.kernels.store_kv import store_kv_cache  # noqa: E402
from aioinfer.model.layers.attention import AttentionMetadata, kv_cache_shape  # noqa: E402
from aioinfer.model.layers.torch_attention import (  # noqa: E402
    TorchAttentionBackend,
    decode_attention,
    prefill_attention,
    write_kv_cache,
)
from aioinfer.model.layers.triton_attention import TritonAttentionBackend  # noqa: E402
from tests.model.kernels.test_triton_kernels import BF16_TOL  # noqa: E402

DEVICE = "cuda"
BF16 = torch.bfloat16
BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, GROUP = 16, 2, 128, 6  # Qwen2.5-1.5B
BLOCK_ELEMENTS = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM  # K and V
NUM_BLOCKS = 2**31 // BLOCK_ELEMENTS + 4096
FREE_NEEDED = 12 * 2**30

# (tokens cached before the step, tokens fed): one token, block multiples, long contexts.
DECODE_CASES = [(0, 1), (15, 1), (16, 1), (333, 1), (700, 1), (2047, 1)]
# Fresh prompts, chunks after ragged and aligned prefixes, a one-token chunk.
PREFILL_CASES = [(0, 300), (1000, 129), (37, 64), (2000, 1), (16, 257)]


@pytest.fixture(scope="module")
def big_cache() -> Iterator[list[torch.Tensor]]:
    """The large cache in a list: tests take it into a local, so that once they have returned
    the teardown drops the last reference and hands the 4 GiB back to the device, for the
    engines of later tests in this process."""
    free, _ = torch.cuda.mem_get_info()
    if free < FREE_NEEDED:
        pytest.skip(f"needs {FREE_NEEDED / 2**30:.0f} GiB free, {free / 2**30:.1f} GiB are")
    cache = torch.empty(
        kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=BF16, device=DEVICE
    )
    assert cache.numel() > 2**31
    holder = [cache]
    del cache
    yield holder
    holder.clear()
    torch.cuda.empty_cache()


@dataclass
class TopBatch:
    """One step whose requests' blocks sit at the top of the cache (and a few at the bottom)."""

    query: torch.Tensor  # [T, H, D], bfloat16
    key: torch.Tensor  # [T, KV, D], this step's new tokens
    value: torch.Tensor
    metadata: AttentionMetadata  # block ids of the large cache
    small_metadata: AttentionMetadata  # the same step over the small cache's ids
    num_low: int  # the large cache's blocks 1 .. num_low are the small cache's first ones,
    top_start: int  # and top_start .. the last block the rest
    scale: float


def top_batch(num_blocks: int, cases: list[tuple[int, int]], seed: int) -> TopBatch:
    needed = [-(-(before + new) // BLOCK_SIZE) for before, new in cases]
    top_start = num_blocks - sum(needed)
    pool = list(range(top_start, num_blocks - 1))
    random.Random(seed).shuffle(pool)
    # The longest request (the last one aside) starts in the very last block, and fills it.
    longest = max(range(len(cases) - 1), key=needed.__getitem__)
    tables = []
    for i, n in enumerate(needed):
        first = [num_blocks - 1] if i == longest else []
        tables.append(first + pool[: n - len(first)])
        del pool[: n - len(first)]
    assert not pool and cases[longest][0] + cases[longest][1] >= BLOCK_SIZE
    # The last request: every other block from the bottom of the cache (block 0 is the null
    # block), so one table mixes offsets below and above 2^31 elements.
    last = tables[-1]
    low = [i // 2 + 1 for i in range(0, len(last), 2)]
    for i, block in zip(range(0, len(last), 2), low, strict=True):
        last[i] = block
    num_low = len(low)

    def small_id(block: int) -> int:
        return block - 1 if block <= num_low else num_low + block - top_start

    small_tables = [[small_id(b) for b in t] for t in tables]
    query_lens = [new for _, new in cases]
    before = [b for b, _ in cases]
    meta = AttentionMetadata.build(query_lens, before, tables, BLOCK_SIZE, DEVICE)
    small_meta = AttentionMetadata.build(query_lens, before, small_tables, BLOCK_SIZE, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=DEVICE).to(BF16)

    t = meta.num_tokens
    return TopBatch(
        query=randn(t, NUM_KV_HEADS * GROUP, HEAD_DIM),
        key=randn(t, NUM_KV_HEADS, HEAD_DIM),
        value=randn(t, NUM_KV_HEADS, HEAD_DIM),
        metadata=meta,
        small_metadata=small_meta,
        num_low=num_low,
        top_start=top_start,
        scale=HEAD_DIM**-0.5,
    )


def used_blocks(cache: torch.Tensor, batch: TopBatch) -> torch.Tensor:
    """A copy of the blocks the batch uses, in the small cache's order."""
    return torch.cat([cache[1 : 1 + batch.num_low], cache[batch.top_start :]])


def set_used_blocks(cache: torch.Tensor, batch: TopBatch, small: torch.Tensor) -> None:
    cache[1 : 1 + batch.num_low].copy_(small[: batch.num_low])
    cache[batch.top_start :].copy_(small[batch.num_low :])


def prepare(cache: torch.Tensor, batch: TopBatch, with_new_tokens: bool) -> torch.Tensor:
    """Fill the large cache with NaN, write every request's prefix (and with_new_tokens this
    step's K/V too) into its blocks; returns the small cache of those blocks."""
    assert batch.top_start * BLOCK_ELEMENTS > 2**31  # every top block lies past 2^31 elements
    cache.fill_(float("nan"))
    small = used_blocks(cache, batch)
    meta = batch.small_metadata
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    tables = meta.block_tables.tolist()
    slots = [
        tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for i, seq_len in enumerate(meta.seq_lens_host)
        for p in range(seq_len - (meta.query_start_loc_host[i + 1] - meta.query_start_loc_host[i]))
    ]
    if slots:
        size = (len(slots), NUM_KV_HEADS, HEAD_DIM)
        k, v = (torch.randn(size, generator=gen, device=DEVICE).to(BF16) for _ in range(2))
        write_kv_cache(small, k, v, torch.tensor(slots, dtype=torch.long, device=DEVICE))
    if with_new_tokens:
        write_kv_cache(small, batch.key, batch.value, meta.slot_mapping)
    set_used_blocks(cache, batch, small)
    return small


def assert_rest_untouched(cache: torch.Tensor, batch: TopBatch) -> None:
    """Nothing was written outside the batch's blocks (they are all NaN still)."""
    for part in (cache[:1], cache[1 + batch.num_low : batch.top_start]):
        for chunk in part.split(16384):
            assert bool(chunk.isnan().all()), "a write landed outside the request's blocks"


def test_store_kv_at_the_top(big_cache: list[torch.Tensor]) -> None:
    cache = big_cache[0]
    batch = top_batch(NUM_BLOCKS, DECODE_CASES + PREFILL_CASES, seed=1)
    small = prepare(cache, batch, with_new_tokens=False)
    # Strided views of one fused tensor, as a QKV projection hands them over.
    fused = torch.cat([batch.key, batch.value], dim=1)
    key, value = fused[:, :NUM_KV_HEADS], fused[:, NUM_KV_HEADS:]
    store_kv_cache(key, value, cache, batch.metadata.slot_mapping)
    write_kv_cache(small, key, value, batch.small_metadata.slot_mapping)
    got = used_blocks(cache, batch)
    assert int((~got.isnan()).sum()) == int((~small.isnan()).sum()) > 0
    torch.testing.assert_close(got, small, atol=0, rtol=0, equal_nan=True)
    assert_rest_untouched(cache, batch)


def test_decode_at_the_top(big_cache: list[torch.Tensor]) -> None:
    cache = big_cache[0]
    batch = top_batch(NUM_BLOCKS, DECODE_CASES, seed=2)
    small = prepare(cache, batch, with_new_tokens=True)
    meta, small_meta = batch.metadata, batch.small_metadata
    out = paged_decode_attention(batch.query, cache, meta.block_tables, meta.seq_lens, batch.scale)
    ref = decode_attention(
        batch.query.float(),
        small.float(),
        small_meta.block_tables,
        small_meta.seq_lens,
        small_meta.max_seq_len,
        batch.scale,
    )
    assert not ref.isnan().any()
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


def test_prefill_at_the_top(big_cache: list[torch.Tensor]) -> None:
    cache = big_cache[0]
    batch = top_batch(NUM_BLOCKS, PREFILL_CASES, seed=3)
    small = prepare(cache, batch, with_new_tokens=True)
    meta = batch.metadata
    out = paged_prefill_attention(
        batch.query,
        cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        batch.scale,
    )
    qsl, small_cache = meta.query_start_loc_host, small.float()
    for i, seq_len in enumerate(meta.seq_lens_host):
        rows = slice(qsl[i], qsl[i + 1])
        ref = prefill_attention(
            batch.query[rows].float(),
            small_cache,
            batch.small_metadata.block_tables[i],
            seq_len,
            batch.scale,
        )
        assert not ref.isnan().any()
        torch.testing.assert_close(out[rows].float(), ref, **BF16_TOL)


def test_backend_mixed_step_at_the_top(big_cache: list[torch.Tensor]) -> None:
    cache = big_cache[0]
    # Store, decode and prefill in one step, as a layer runs them.
    batch = top_batch(NUM_BLOCKS, DECODE_CASES + PREFILL_CASES, seed=4)
    small = prepare(cache, batch, with_new_tokens=False).float()
    ref = TorchAttentionBackend().forward(
        batch.query.float(),
        batch.key.float(),
        batch.value.float(),
        small,
        batch.small_metadata,
        batch.scale,
    )
    out = TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale
    )
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)
    got = used_blocks(cache, batch).float()
    torch.testing.assert_close(got, small, atol=0, rtol=0, equal_nan=True)
    assert_rest_untouched(cache, batch)
