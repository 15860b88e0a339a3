"""The triton paged-attention kernels compiled for CUDA, in bfloat16 at serving-like shapes.

The same checks as test_triton_kernels.py (which also runs natively, in float32, when CUDA is
present), with longer contexts, more heads, bfloat16 tolerances, and a CUDA-graph capture of the
decode path replayed with other context lengths; the GQA groups and head sizes of served models
(6 and 7 query heads per KV head, head_dim 256); and a decode step wider than the largest CUDA
graph.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
# Skip before importing the kernels: a kernel module imported without TRITON_INTERPRET=1 stays
# compiled-only for the whole process, and without CUDA the CPU suite needs it interpreted.
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from aioinfer.model.kernels.paged_decode import paged_decode_attention  # noqa: E402
from aioinfer.model.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from aioinfer.model.kernels.store_kv import store_kv_cache  # noqa: E402
from aioinfer.model.layers.attention import AttentionMetadata  # noqa: E402
from aioinfer.model.layers.torch_attention import (  # noqa: E402
    TorchAttentionBackend,
    decode_attention,
    prefill_attention,
    write_kv_cache,
)
from aioinfer.model.layers.triton_attention import TritonAttentionBackend  # noqa: E402
from tests.model.kernels.test_triton_kernels import (  # noqa: E402
    BF16_TOL,
    PagedBatch,
    make_batch,
    reference_forward,
    tiny_llama_logits,
)

BF16 = torch.bfloat16
HEADS = 32  # query heads; KV heads = HEADS // group


def decode_cases(seed: int, count: int = 32, max_len: int = 2048) -> list[tuple[int, int]]:
    """Random context lengths plus the edges: one token, a block multiple, the longest."""
    rng = random.Random(seed)
    edges = [(0, 1), (15, 1), (max_len - 1, 1)]
    return edges + [(rng.randrange(max_len), 1) for _ in range(count - len(edges))]


# Fresh prompts, chunks after block-aligned and ragged prefixes, a one-token chunk.
PREFILL_CASES = [(0, 512), (1000, 256), (37, 700), (4095, 1), (16, 1024), (2048, 64)]


def batch_of(
    cases: list[tuple[int, int]],
    block_size: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = BF16,
    seed: int = 0,
) -> PagedBatch:
    return make_batch(
        cases,
        block_size=block_size,
        num_kv_heads=HEADS // group,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=seed,
    )


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(block_size: int) -> None:
    batch = batch_of(PREFILL_CASES, block_size, 4, 128)
    fused = torch.cat([batch.key, batch.value], dim=1)  # strided views, as from a QKV split
    num_kv = batch.key.shape[1]
    key, value = fused[:, :num_kv], fused[:, num_kv:]
    expected = batch.kv_cache.clone()
    write_kv_cache(expected, key, value, batch.metadata.slot_mapping)
    store_kv_cache(key, value, batch.kv_cache, batch.metadata.slot_mapping)
    torch.testing.assert_close(batch.kv_cache, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_bf16(block_size: int, head_dim: int, group: int) -> None:
    check_decode_bf16(batch_of(decode_cases(group), block_size, group, head_dim))


def check_decode_bf16(batch: PagedBatch) -> None:
    """The decode kernel over the batch's cache against the torch reference in float32."""
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    out = paged_decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, batch.scale
    )
    ref = decode_attention(
        batch.query.float(),
        batch.kv_cache.float(),
        meta.block_tables,
        meta.seq_lens,
        meta.max_seq_len,
        batch.scale,
    )
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


def test_decode_float32_long_context() -> None:
    batch = batch_of(decode_cases(3, count=6, max_len=16384), 16, 4, 128, torch.float32)
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    out = paged_decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, batch.scale
    )
    ref = decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, batch.scale
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_bf16(block_size: int, head_dim: int, group: int) -> None:
    check_prefill_bf16(batch_of(PREFILL_CASES, block_size, group, head_dim, seed=group))


def check_prefill_bf16(batch: PagedBatch) -> None:
    """The prefill kernel over the batch's cache against the torch reference in float32, one
    request at a time."""
    meta = batch.metadata
    write_kv_cache(batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
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
    cache = batch.kv_cache.float()
    for i, seq_len in enumerate(meta.seq_lens_host):
        rows = slice(qsl[i], qsl[i + 1])
        ref = prefill_attention(
            batch.query[rows].float(),
            cache,
            meta.block_tables[i],
            seq_len,
            batch.scale,
        )
        torch.testing.assert_close(out[rows].float(), ref, **BF16_TOL)


# Served models whose query heads are no multiple of HEADS // group: Qwen2.5-1.5B (12 query,
# 2 KV heads: group 6) and Qwen2.5-7B (28 / 4: group 7), with head_dim 256 as Gemma 3's. The
# prefill tile then holds 64 // group = 10 or 9 query tokens (60 or 63 of its 64 rows used) and
# the decode program pads the group to 16 rows. (group, KV heads, head_dim); block size 16.
SERVING_SHAPES = [(6, 2, 64), (6, 2, 128), (6, 2, 256), (7, 4, 128), (7, 4, 256)]


def serving_batch(
    cases: list[tuple[int, int]], group: int, num_kv_heads: int, head_dim: int, seed: int
) -> PagedBatch:
    return make_batch(
        cases,
        block_size=16,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=BF16,
        seed=seed,
    )


@pytest.mark.parametrize(("group", "num_kv_heads", "head_dim"), SERVING_SHAPES)
def test_decode_bf16_serving_shapes(group: int, num_kv_heads: int, head_dim: int) -> None:
    seed = 100 * group + head_dim
    batch = serving_batch(decode_cases(seed), group, num_kv_heads, head_dim, seed)
    assert batch.query.shape[1] == group * num_kv_heads
    check_decode_bf16(batch)


@pytest.mark.parametrize(("group", "num_kv_heads", "head_dim"), SERVING_SHAPES)
def test_prefill_bf16_serving_shapes(group: int, num_kv_heads: int, head_dim: int) -> None:
    seed = 100 * group + head_dim
    check_prefill_bf16(serving_batch(PREFILL_CASES, group, num_kv_heads, head_dim, seed))


def test_backend_decode_wider_than_the_graphs() -> None:
    # 600 decode requests: more than the largest CUDA graph (512) holds, so the engine runs such
    # a step eagerly, with the grids 600 requests wide. Qwen2.5-1.5B's heads.
    cases = decode_cases(600, count=600, max_len=512)
    batch = serving_batch(cases, 6, 2, 128, seed=600)
    assert batch.metadata.num_decodes == len(cases) == 600
    ref, ref_cache = reference_forward(batch)
    out = TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale
    )
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)
    torch.testing.assert_close(batch.kv_cache.float(), ref_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_backend_mixed_step(dtype: torch.dtype) -> None:
    cases = [*decode_cases(9, count=40), (0, 300), (500, 128), (33, 1), (64, 700)]
    batch = batch_of(cases, 16, 4, 128, dtype, seed=9)
    ref, ref_cache = reference_forward(batch)
    out = TritonAttentionBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale
    )
    tol = BF16_TOL if dtype == BF16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(batch.kv_cache.float(), ref_cache, atol=0, rtol=0, equal_nan=True)


def test_decode_cuda_graph_replays_other_lengths() -> None:
    cases = decode_cases(21, count=16)
    batch = batch_of(cases, 16, 4, 128, seed=21)
    long = batch.metadata
    # Capture a step with shorter contexts over the same (padded, so equally wide) block
    # tables and other inputs, then replay it with the long step's values copied in.
    short = AttentionMetadata.build(
        [1] * len(cases), [b // 3 for b, _ in cases], long.block_tables.tolist(), 16, "cuda"
    )
    inputs = [torch.randn_like(t) for t in (batch.query, batch.key, batch.value)]
    backend = TritonAttentionBackend()

    def step() -> torch.Tensor:
        return backend.forward(*inputs, batch.kv_cache, short, batch.scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for static, live in zip(inputs, (batch.query, batch.key, batch.value), strict=True):
        static.copy_(live)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        getattr(short, name).copy_(getattr(long, name))
    ref, ref_cache = reference_forward(batch)  # from the cache as it is before the replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)
    torch.testing.assert_close(batch.kv_cache.float(), ref_cache, atol=0, rtol=0, equal_nan=True)


def test_tiny_llama_bf16_triton_matches_torch_backend() -> None:
    cases = [(40, 1), (17, 1), (3, 1), (30, 25), (0, 60), (16, 16)]
    ref = tiny_llama_logits(TorchAttentionBackend(), cases, dtype=BF16, block_size=16)
    out = tiny_llama_logits(TritonAttentionBackend(), cases, dtype=BF16, block_size=16)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, atol=0.05 * scale, rtol=0.05)
