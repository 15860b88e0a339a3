"""The triton paged-attention kernels and backend against the torch reference backend.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set here, before any kernel module is
imported); with CUDA the same checks run natively. Every case draws fresh random inputs onto a
NaN-filled cache whose blocks are handed out in shuffled order, so a kernel that reads a slot
it does not own, or ignores the block table, fails loudly.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from aioinfer.model.forward_context import forward_context
from aioinfer.model.kernels.paged_decode import (
    _decode_split_kernel,
    paged_decode_attention,
)
from aioinfer.model.kernels.paged_prefill import paged_prefill_attention
from aioinfer.model.kernels.store_kv import store_kv_cache
from aioinfer.model.layers.attention import AttentionMetadata, kv_cache_shape
from aioinfer.model.layers.torch_attention import (
    TorchAttentionBackend,
    decode_attention,
    prefill_attention,
    write_kv_cache,
)
from aioinfer.model.layers.triton_attention import TritonAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and type(_decode_split_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "the triton kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this module on its own",
        allow_module_level=True,
    )

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


@dataclass
class PagedBatch:
    """One step's inputs: the cache holds every request's prefix, not yet its new tokens."""

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KV, D], this step's new tokens
    value: torch.Tensor
    kv_cache: torch.Tensor  # [N, 2, block_size, KV, D], NaN where nothing was written
    metadata: AttentionMetadata
    scale: float


def make_batch(
    cases: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = DEVICE,
    seed: int = 0,
) -> PagedBatch:
    """Requests given as (tokens cached before the step, tokens fed this step)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_blocks = sum(-(-(before + new) // block_size) for before, new in cases) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(b + n) // block_size))] for b, n in cases]
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    # Each request's prefix was written by earlier steps.
    slots = torch.tensor(
        [
            t[p // block_size] * block_size + p % block_size
            for (b, _), t in zip(cases, tables, strict=True)
            for p in range(b)
        ],
        dtype=torch.long,
        device=device,
    )
    size = (len(slots), num_kv_heads, head_dim)
    write_kv_cache(kv_cache, randn(*size), randn(*size), slots)

    meta = AttentionMetadata.build(
        [n for _, n in cases], [b for b, _ in cases], tables, block_size, device
    )
    t = meta.num_tokens
    return PagedBatch(
        query=randn(t, num_kv_heads * group, head_dim),
        key=randn(t, num_kv_heads, head_dim),
        value=randn(t, num_kv_heads, head_dim),
        kv_cache=kv_cache,
        metadata=meta,
        scale=head_dim**-0.5,
    )


def reference_forward(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend in float32 on a copy of the cache: (output, cache after the step)."""
    cache = batch.kv_cache.float().clone()
    out = TorchAttentionBackend().forward(
        batch.query.float(),
        batch.key.float(),
        batch.value.float(),
        cache,
        batch.metadata,
        batch.scale,
    )
    return out, cache


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


# --- store_kv -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kv_matches_reference(block_size: int, dtype: torch.dtype) -> None:
    batch = make_batch(
        [(3, 1), (0, 7), (16, 5), (9, 14)],
        block_size=block_size,
        num_kv_heads=2,
        group=1,
        head_dim=64,
        dtype=dtype,
    )
    # key/value as strided views of one fused tensor, the way a QKV projection hands them over.
    fused = torch.cat([batch.key, batch.value], dim=1)
    key, value = fused[:, :2], fused[:, 2:]
    expected = batch.kv_cache.clone()
    write_kv_cache(expected, key, value, batch.metadata.slot_mapping)
    store_kv_cache(key, value, batch.kv_cache, batch.metadata.slot_mapping)
    torch.testing.assert_close(batch.kv_cache, expected, atol=0, rtol=0, equal_nan=True)


def test_store_kv_skips_negative_slots_and_casts() -> None:
    kv_cache = torch.zeros(kv_cache_shape(3, 4, 2, 16), dtype=torch.bfloat16, device=DEVICE)
    key = torch.randn(3, 2, 16, device=DEVICE)
    value = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 6], device=DEVICE)
    store_kv_cache(key, value, kv_cache, slots)
    expected = torch.zeros_like(kv_cache)
    write_kv_cache(expected, key[[0, 2]], value[[0, 2]], slots[[0, 2]])
    # The interpreter rounds float32 -> bfloat16 toward zero, a GPU to nearest: one ulp apart.
    one_ulp = 0.0 if DEVICE.type == "cuda" else 2.0**-7
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=one_ulp)
    assert (kv_cache[[0, 2]] == 0).all()  # slot -1 wrote nothing; 5 and 6 sit in block 1


def test_store_kv_rejects_bad_shapes() -> None:
    kv_cache = torch.zeros(kv_cache_shape(2, 4, 2, 16), device=DEVICE)
    key = torch.zeros(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_cache(key, key, kv_cache, torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="kv_cache"):
        store_kv_cache(key[:, :1], key[:, :1], kv_cache, torch.zeros(3, device=DEVICE).long())


# --- decode -------------------------------------------------------------------------------------

# Context lengths (this step's token included): one token, exact block multiples, ragged ones,
# and a long one that spreads over every split.
DECODE_CASES = [(0, 1), (15, 1), (31, 1), (36, 1), (94, 1)]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    batch = make_batch(
        DECODE_CASES,
        block_size=block_size,
        num_kv_heads=2 if group < 8 else 1,
        group=group,
        head_dim=head_dim,
        seed=block_size + head_dim + group,
    )
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    out = paged_decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, batch.scale
    )
    ref = decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, batch.scale
    )
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 3, 12])
def test_decode_split_counts_agree(num_splits: int) -> None:
    # 12 splits leave half of them empty for these lengths; 1 runs the whole context in one.
    batch = make_batch(DECODE_CASES, block_size=16, num_kv_heads=2, group=4, head_dim=64, seed=7)
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    out = paged_decode_attention(
        batch.query,
        batch.kv_cache,
        meta.block_tables,
        meta.seq_lens,
        batch.scale,
        num_splits=num_splits,
    )
    ref = decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, batch.scale
    )
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_decode_bfloat16_and_padding_request() -> None:
    batch = make_batch(
        DECODE_CASES, block_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16
    )
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    # A padding request (seq_len 0, as in a CUDA-graph batch filled up) must give zeros.
    seq_lens = torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(1)])
    tables = torch.cat([meta.block_tables, meta.block_tables[:1]])
    query = torch.cat([batch.query, batch.query[:1]])
    out = paged_decode_attention(query, batch.kv_cache, tables, seq_lens, batch.scale)
    assert out.dtype == torch.bfloat16
    ref = decode_attention(
        batch.query.float(),
        batch.kv_cache.float(),
        meta.block_tables,
        meta.seq_lens,
        meta.max_seq_len,
        batch.scale,
    )
    torch.testing.assert_close(out[:-1].float(), ref, **BF16_TOL)
    assert (out[-1] == 0).all()


# --- prefill ------------------------------------------------------------------------------------

# Fresh prompts, chunks after cached prefixes (block-aligned and not, as after a prefix hit or an
# earlier chunk), a one-token chunk and a query longer than one query tile.
PREFILL_CASES = [(0, 9), (7, 5), (16, 20), (33, 1), (3, 41)]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    batch = make_batch(
        PREFILL_CASES,
        block_size=block_size,
        num_kv_heads=2 if group < 8 else 1,
        group=group,
        head_dim=head_dim,
        seed=block_size * head_dim + group,
    )
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    # Every request through the prefill kernel, the one-token chunk included.
    out = paged_prefill_attention(
        batch.query,
        batch.kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        batch.scale,
    )
    qsl = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        rows = slice(qsl[i], qsl[i + 1])
        ref = prefill_attention(
            batch.query[rows], batch.kv_cache, meta.block_tables[i], seq_len, batch.scale
        )
        torch.testing.assert_close(out[rows], ref, **FP32_TOL)


def test_prefill_leaves_other_rows_alone() -> None:
    batch = make_batch([(0, 1), (4, 6)], block_size=4, num_kv_heads=1, group=2, head_dim=64)
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    out = torch.full_like(batch.query, 7.0)
    paged_prefill_attention(
        batch.query,
        batch.kv_cache,
        meta.query_start_loc[1:],
        meta.seq_lens[1:],
        meta.block_tables[1:],
        meta.max_query_len,
        batch.scale,
        out=out,
    )
    assert (out[0] == 7.0).all()
    ref = prefill_attention(batch.query[1:], batch.kv_cache, meta.block_tables[1], 10, batch.scale)
    torch.testing.assert_close(out[1:], ref, **FP32_TOL)


# --- backend ------------------------------------------------------------------------------------

STEPS: dict[str, list[tuple[int, int]]] = {
    "mixed": [(5, 1), (16, 1), (0, 1), (37, 1), (0, 9), (7, 5), (16, 19), (3, 1)],
    "decode_only": [(5, 1), (16, 1), (47, 1)],
    "prefill_only": [(0, 16), (12, 5), (6, 1)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_backend_matches_torch_backend(step: str, dtype: torch.dtype) -> None:
    batch = make_batch(
        STEPS[step], block_size=4, num_kv_heads=2, group=4, head_dim=64, dtype=dtype, seed=11
    )
    ref, ref_cache = reference_forward(batch)
    out = TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale
    )
    assert out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype))
    # The cache holds exactly what the reference wrote (bfloat16 values round-trip exactly).
    torch.testing.assert_close(batch.kv_cache.float(), ref_cache, atol=0, rtol=0, equal_nan=True)


def test_backend_odd_shapes() -> None:
    # A head dim that is no power of two (padded lanes), GQA group 3 and 5-token blocks.
    batch = make_batch(STEPS["mixed"], block_size=5, num_kv_heads=2, group=3, head_dim=40, seed=13)
    ref, _ = reference_forward(batch)
    out = TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale
    )
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_tiny_llama_triton_matches_torch_backend() -> None:
    # A decode, a chunk after a 6-token prefix and a fresh prompt, as in one mixed step.
    cases = [(10, 1), (6, 7), (0, 9)]
    ref = tiny_llama_logits(TorchAttentionBackend(), cases)
    out = tiny_llama_logits(TritonAttentionBackend(), cases)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def tiny_llama_logits(
    backend: TorchAttentionBackend | TritonAttentionBackend,
    cases: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    block_size: int = 4,
) -> torch.Tensor:
    """Logits of one step of our tiny Llama under `backend`, float32 [tokens, vocab].

    Requests are (tokens cached before, tokens fed); their prefixes are computed first by the
    torch backend, so only the step under test differs between backends. Same seed, same step.
    """
    from aioinfer.model.registry import get_model_class
    from tests.support.tiny_models import make_variant

    hf = make_variant("llama")
    model = get_model_class(hf.config)(hf.config)
    model.load_state_dict(hf.state_dict(), strict=False)
    model.tie_weights()
    model = model.to(device=DEVICE, dtype=dtype).eval()

    num_blocks = sum(-(-(b + n) // block_size) for b, n in cases) + 3
    free = list(range(num_blocks))
    random.Random(5).shuffle(free)
    gen = torch.Generator().manual_seed(0)
    feeds = [
        Feed(
            torch.randint(0, hf.config.vocab_size, (b + n,), generator=gen),
            b,
            n,
            [free.pop() for _ in range(-(-(b + n) // block_size))],
        )
        for b, n in cases
    ]
    shape = model.kv_cache_shape(num_blocks, block_size)
    caches = [
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        for _ in range(hf.config.num_hidden_layers)
    ]
    prefixes = [Feed(f.token_ids, 0, f.start, f.block_table) for f in feeds if f.start > 0]
    if prefixes:
        forward(model, caches, prefixes, block_size, None)
    return forward(model, caches, feeds, block_size, backend)


@dataclass
class Feed:
    """Tokens token_ids[start : start + num_tokens] of one request, fed in one step."""

    token_ids: torch.Tensor
    start: int
    num_tokens: int
    block_table: list[int]


def forward(
    model: torch.nn.Module,
    caches: list[torch.Tensor],
    feeds: list[Feed],
    block_size: int,
    backend: TorchAttentionBackend | TritonAttentionBackend | None,
) -> torch.Tensor:
    """One forward pass over `feeds`; the logits of every fed token, float32."""
    meta = AttentionMetadata.build(
        [f.num_tokens for f in feeds],
        [f.start for f in feeds],
        [f.block_table for f in feeds],
        block_size,
        DEVICE,
    )
    ids = torch.cat([f.token_ids[f.start : f.start + f.num_tokens] for f in feeds]).to(DEVICE)
    positions = torch.cat([torch.arange(f.start, f.start + f.num_tokens) for f in feeds])
    with forward_context(meta, caches, backend):
        hidden = model(ids, positions.to(DEVICE))
    return model.compute_logits(hidden).float()


# --- sliding windows ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "softcap"), [(1, 0.0), (6, 0.0), (16, 0.0), (40, 0.0), (0, 2.0), (6, 2.0)]
)
def test_windowed_decode_and_prefill_match_reference(window: int, softcap: float) -> None:
    """Each kernel against the torch reference (itself checked against a brute force in
    tests/model/cpu/test_sliding_window.py) with a window shorter and longer than a block and a
    key tile, and with soft-capped scores."""
    batch = make_batch(
        DECODE_CASES + PREFILL_CASES,
        block_size=4,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        seed=window,
    )
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    nd = meta.num_decodes
    out = paged_decode_attention(
        batch.query[:nd],
        batch.kv_cache,
        meta.block_tables[:nd],
        meta.seq_lens[:nd],
        batch.scale,
        window=window,
        softcap=softcap,
    )
    ref = decode_attention(
        batch.query[:nd],
        batch.kv_cache,
        meta.block_tables[:nd],
        meta.seq_lens[:nd],
        max(meta.seq_lens_host[:nd]),
        batch.scale,
        window=window,
        softcap=softcap,
    )
    torch.testing.assert_close(out, ref, **FP32_TOL)
    out = paged_prefill_attention(
        batch.query,
        batch.kv_cache,
        meta.query_start_loc[nd:],
        meta.seq_lens[nd:],
        meta.block_tables[nd:],
        meta.max_query_len,
        batch.scale,
        window=window,
        softcap=softcap,
    )
    qsl = meta.query_start_loc_host
    for i in range(nd, meta.num_reqs):
        rows = slice(qsl[i], qsl[i + 1])
        ref = prefill_attention(
            batch.query[rows],
            batch.kv_cache,
            meta.block_tables[i],
            meta.seq_lens_host[i],
            batch.scale,
            window,
            softcap,
        )
        torch.testing.assert_close(out[rows], ref, **FP32_TOL)
