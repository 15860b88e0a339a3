"""The torch attention backend over the paged KV cache against naive dense causal attention."""

from __future__ import annotations

import random

import pytest
import torch

from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import ScheduledChunk
from aioinfer.model.forward_context import forward_context, get_forward_context
from aioinfer.model.layers.attention import Attention, AttentionMetadata, kv_cache_shape
from aioinfer.model.layers.torch_attention import TorchAttentionBackend, write_kv_cache

NUM_KV_HEADS = 2
HEAD_DIM = 16
NUM_BLOCKS = 48


def dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [L, H, D] at the last L of S positions; keys/values [S, KV, D] -> [L, H, D]."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", query.float(), k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def slots(table: list[int], positions: range, block_size: int) -> torch.Tensor:
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])


# (tokens cached before the step, tokens fed this step) per request.
LAYOUTS: dict[str, list[tuple[int, int]]] = {
    "mixed": [(5, 1), (16, 1), (0, 1), (31, 1), (0, 9), (7, 5), (16, 32), (3, 17)],
    "decode_only": [(5, 1), (16, 1), (32, 1), (0, 1), (47, 1)],
    "prefill_only": [(0, 16), (12, 5), (6, 16), (0, 7), (32, 1)],
}


def run_case(
    layout: str, block_size: int, gqa: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(backend output, dense reference, cache-content error) for one random batch."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cases = LAYOUTS[layout]
    num_heads = NUM_KV_HEADS * gqa
    scale = HEAD_DIM**-0.5
    kv_cache = torch.full(
        kv_cache_shape(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype
    )
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tables, full_k, full_v, queries, refs = [], [], [], [], []
    for before, new in cases:
        seq_len = before + new
        table = [free.pop() for _ in range(-(seq_len // -block_size))]
        keys, values = (
            randn(seq_len, NUM_KV_HEADS, HEAD_DIM),
            randn(seq_len, NUM_KV_HEADS, HEAD_DIM),
        )
        if before:  # the prefix was written by an earlier step
            write_kv_cache(
                kv_cache, keys[:before], values[:before], slots(table, range(before), block_size)
            )
        query = randn(new, num_heads, HEAD_DIM)
        tables.append(table)
        full_k.append(keys)
        full_v.append(values)
        queries.append(query)
        refs.append(dense_causal_attention(query, keys, values, scale))

    meta = AttentionMetadata.build(
        [new for _, new in cases], [before for before, _ in cases], tables, block_size
    )
    new_k = torch.cat([k[before:] for k, (before, _) in zip(full_k, cases, strict=True)])
    new_v = torch.cat([v[before:] for v, (before, _) in zip(full_v, cases, strict=True)])
    out = TorchAttentionBackend().forward(torch.cat(queries), new_k, new_v, kv_cache, meta, scale)

    cache_err = torch.zeros(())
    for table, keys, values in zip(tables, full_k, full_v, strict=True):
        idx = slots(table, range(keys.shape[0]), block_size)
        flat = kv_cache.transpose(0, 1).reshape(2, -1, NUM_KV_HEADS, HEAD_DIM)
        cache_err = torch.maximum(cache_err, (flat[0, idx] - keys).abs().max().float())
        cache_err = torch.maximum(cache_err, (flat[1, idx] - values).abs().max().float())
    return out, torch.cat(refs), cache_err


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_backend_matches_dense_attention(layout: str, gqa: int, block_size: int) -> None:
    out, ref, cache_err = run_case(layout, block_size, gqa)
    assert cache_err.item() == 0.0
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_backend_bfloat16_close_to_dense() -> None:
    out, ref, cache_err = run_case("mixed", 16, 4, dtype=torch.bfloat16)
    assert cache_err.item() == 0.0
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_build_matches_step_contract() -> None:
    params = SamplingParams()
    chunks = [
        ScheduledChunk("a", (1,), 9, (7, 2, 9), True, params),
        ScheduledChunk("b", (1, 2, 3), 6, (7, 2, 9), True, params),
        ScheduledChunk("c", (4, 5), 0, (3,), False, params),
    ]
    meta = AttentionMetadata.build(
        [c.num_tokens for c in chunks],
        [c.start_pos for c in chunks],
        [c.block_table for c in chunks],
        block_size=4,
    )
    expected = [s for c in chunks for s in c.slot_mapping(4)]
    assert meta.slot_mapping.tolist() == expected
    assert meta.query_start_loc.tolist() == [0, 1, 4, 6]
    assert meta.seq_lens.tolist() == [10, 9, 2]
    assert meta.block_tables.tolist() == [[7, 2, 9], [7, 2, 9], [3, 0, 0]]
    assert (meta.num_decodes, meta.max_query_len, meta.max_seq_len) == (1, 3, 10)
    assert not meta.decode_only


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (([1], [0, 0], [[0]]), "one entry per request"),
        (([0], [0], [[0]]), r"query_lens\[0\]"),
        (([1], [-1], [[0]]), r"context_lens_before\[0\]"),
        (([3], [4], [[0]]), r"block_tables\[0\]"),
    ],
)
def test_build_rejects_bad_input(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AttentionMetadata.build(*args, block_size=4)


def test_forward_context_is_scoped() -> None:
    meta = AttentionMetadata.build([1], [0], [[0]], block_size=4)
    with pytest.raises(RuntimeError, match="forward_context"):
        get_forward_context()
    with forward_context(meta, []) as outer:
        assert get_forward_context() is outer
        with forward_context(meta, []) as inner:
            assert get_forward_context() is inner
        assert get_forward_context() is outer
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_attention_layer_uses_its_cache_and_the_context_backend() -> None:
    shape = kv_cache_shape(4, 4, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.full(shape, float("nan")) for _ in range(2)]
    meta = AttentionMetadata.build([3], [0], [[2]], block_size=4)
    layer = Attention(4, NUM_KV_HEADS, HEAD_DIM, layer_idx=1)
    q = torch.randn(3, 4, HEAD_DIM)
    kv = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    with forward_context(meta, caches):
        out = layer(q, kv, kv)
    torch.testing.assert_close(out, dense_causal_attention(q, kv, kv, HEAD_DIM**-0.5))
    assert caches[0].isnan().all()
    assert not caches[1][2, :, :3].isnan().any()

    calls: list[int] = []

    class Recording(TorchAttentionBackend):
        def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
            calls.append(1)
            return super().forward(*args, **kwargs)  # type: ignore[arg-type]

    with forward_context(meta, caches, Recording()):
        layer(q, kv, kv)
    assert calls == [1]
