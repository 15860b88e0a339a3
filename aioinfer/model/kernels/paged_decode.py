"""Paged decode attention: one query token per request over its cached context, split-K.

Each request's context is cut into NUM_SPLITS contiguous ranges (rounded up to BLOCK_N tokens)
so long contexts spread over many programs; a second kernel merges the partial results by
their log-sum-exp. With seq_len 150, NUM_SPLITS 4 and BLOCK_N 32 (split_len = 64):

    split 0: tokens [0, 64)   split 1: [64, 128)   split 2: [128, 150)   split 3: empty

The grid depends only on the batch size and head counts, never on the context lengths, so
a launch can be captured in a CUDA graph and replayed with other lengths. A program serves
all GROUP query heads that share one KV head: each K/V tile is loaded once for the group.
Softmax runs in base 2 (exp2 with scale * log2(e)); accumulation is float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from aioinfer.model.kernels.common import (
    check_heads,
    check_kv_cache,
    dot_dtype,
    dot_floor,
    dot_precision,
    on_cuda,
    pow2_at_least,
)

LOG2E = math.log2(math.e)
LOG2E_F = tl.constexpr(LOG2E)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    scale_log2,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    # A sliding window's keys only: the splits share [first, seq_len).
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, G_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + req * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    # A finite floor instead of -inf: a fully masked row never computes inf - inf.
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = block_tables_ptr + req * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k_ptrs = cache_ptr + row[:, None] + d[None, :] * stride_cd
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0).to(DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
        if SOFTCAP:  # cap * tanh(score / cap), in base 2: tanh(x) = 1 - 2 / (exp(2x) + 1)
            capped = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 / softcap)) + 1.0))
            s = capped * LOG2E_F
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    # An empty split reports lse = -inf, which gives it zero weight in the merge.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    out = acc / l_safe[:, None]
    mid = mid_out_ptr + req * stride_mob + heads[:, None] * stride_moh + split * stride_mos
    tl.store(mid + d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(mid_lse_ptr + req * stride_mlb + heads * stride_mlh + split, lse, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    mid_out_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < NUM_SPLITS
    d_ok = d < HEAD_DIM
    lse = tl.load(
        mid_lse_ptr + req * stride_mlb + head * stride_mlh + s, mask=s_ok, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0 (a padding request): output zeros
    weight = tl.exp2(lse - m)  # [S_PAD]
    part = tl.load(
        mid_out_ptr + req * stride_mob + head * stride_moh + s[:, None] * stride_mos + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + req * stride_ob + head * stride_oh + d * stride_od
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Fixed launch sizes: no autotuning, so the CPU interpreter stays fast."""

    block_n: int  # context tokens per loop iteration
    num_splits: int  # split-K ranges per (request, KV head)
    num_warps: int
    num_stages: int


def decode_config(query: torch.Tensor) -> DecodeConfig:
    if not on_cuda(query):
        return DecodeConfig(block_n=16, num_splits=4, num_warps=1, num_stages=1)
    # Halve the K/V tile for 4-byte or wide heads so two pipelined stages fit in shared memory.
    wide = query.element_size() > 2 or query.shape[2] > 128
    # 16 splits keep a GPU's SMs busy for small batches with long contexts.
    return DecodeConfig(block_n=32 if wide else 64, num_splits=16, num_warps=4, num_stages=2)


def _check_decode_args(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> int:
    """The GQA group size, after checking that the shapes fit together."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 0
    group = check_heads(num_heads, num_kv_heads)
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {block_tables.shape}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [{batch}], got {tuple(seq_lens.shape)}")
    return group


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per request: query [B, H, D] over seq_lens[b] cached tokens -> [B, H, D]
    (with a sliding `window`, over the last `window` of them).

    The query of request b sits at position seq_lens[b] - 1 and its K/V must already be in
    kv_cache [N, 2, block_size, KV, D]; block_tables [B, max_blocks] lists each request's
    blocks in order. A request with seq_len 0 gets zeros. `out` ([B, H, D], may be a view) is
    written in place when given; `num_splits` overrides the device's default.
    """
    group = _check_decode_args(query, kv_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    cfg = decode_config(query)
    splits = cfg.num_splits if num_splits is None else num_splits
    if splits <= 0:
        raise ValueError(f"num_splits must be > 0, got {splits}")
    if batch == 0:
        return out

    mid_out = torch.empty(
        (batch, num_heads, splits, head_dim), dtype=torch.float32, device=query.device
    )
    mid_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=query.device)
    d_pad = pow2_at_least(head_dim, dot_floor(query))
    operand_dtype = dot_dtype(query)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        mid_out,
        mid_lse,
        scale * LOG2E,
        window,
        softcap,
        *query.stride(),
        *kv_cache.stride(),
        block_tables.stride(0),
        *mid_out.stride()[:3],
        *mid_lse.stride()[:2],
        GROUP=group,
        G_PAD=pow2_at_least(group, dot_floor(query)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=splits,
        DOT_DTYPE=operand_dtype,
        PRECISION=dot_precision(operand_dtype),
        SOFTCAP=softcap > 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        mid_out,
        mid_lse,
        out,
        *mid_out.stride()[:3],
        *mid_lse.stride()[:2],
        *out.stride(),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        NUM_SPLITS=splits,
        S_PAD=triton.next_power_of_2(splits),
        num_warps=cfg.num_warps,
    )
    return out
