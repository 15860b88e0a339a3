"""Paged prefill attention: every multi-token request of a step in one launch.

Request r feeds q_len new tokens at the end of a seq_len context; its first
prefix = seq_len - q_len tokens (an earlier chunk, or blocks shared on a prefix-cache hit) are
already in the cache, and so are the new tokens' K/V (stored before this kernel runs). Query j
sits at position prefix + j and sees keys 0 .. prefix + j, all read through the block table.

The grid is (requests, query tiles, KV heads). A program takes BLOCK_Q query tokens times the
GROUP query heads of one KV head as the rows of one tile, so each K/V tile is loaded once for
the whole group:

    rows   0      1      ...  GROUP-1  GROUP  ...
    token  t0     t0          t0       t1
    head   kv*G   kv*G+1      kv*G+G-1 kv*G

and walks the context up to its last query's position with an online softmax (base 2, float32).
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
def _prefill_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + req + 1) - q_start).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_ROWS)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # query token within the request
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    tokens = q_start + q_idx
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = prefix + q_idx

    # Keys past the tile's last query position are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, prefix + (q_tile + 1) * BLOCK_Q)
    # A finite floor instead of -inf: padding rows (all masked) never compute inf - inf.
    m_i = tl.full([BLOCK_ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, D_PAD], tl.float32)
    table = block_tables_ptr + req * stride_bt
    # With a sliding window, keys before the window of the tile's first query are masked for
    # every row: start at the tile of BLOCK_N keys that holds the first one it sees.
    kv_start = tl.where(window > 0, tl.maximum(prefix + q_tile * BLOCK_Q - window + 1, 0), 0)
    for tile in range((kv_start // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k_ptrs = cache_ptr + row[:, None] + d[None, :] * stride_cd
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0).to(DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_ROWS, BLOCK_N]
        if SOFTCAP:  # cap * tanh(score / cap), in base 2: tanh(x) = 1 - 2 / (exp(2x) + 1)
            capped = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 / softcap)) + 1.0))
            s = capped * LOG2E_F
        causal = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        causal &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = (
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
    )
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Fixed launch sizes: no autotuning, so the CPU interpreter stays fast."""

    block_rows: int  # rows of a query tile: BLOCK_Q tokens x GROUP heads
    block_n: int  # context tokens per loop iteration
    num_warps: int
    num_stages: int


def prefill_config(query: torch.Tensor, group: int) -> PrefillConfig:
    if not on_cuda(query):
        return PrefillConfig(pow2_at_least(group, 32), block_n=32, num_warps=1, num_stages=1)
    # Halve the K/V tile for 4-byte or wide heads so two pipelined stages fit in shared memory.
    wide = query.element_size() > 2 or query.shape[2] > 128
    block_n = 32 if wide else 64
    return PrefillConfig(pow2_at_least(group, 64), block_n, num_warps=4, num_stages=2)


def _check_prefill_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> int:
    """The GQA group size, after checking that the shapes fit together."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 0
    group = check_heads(num_heads, num_kv_heads)
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_reqs + 1}] (one more than seq_lens), "
            f"got {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables must be [{num_reqs}, max_blocks], got {block_tables.shape}")
    return group


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of R requests' new tokens over their paged contexts, one launch; with a
    sliding `window`, a query at position p sees keys p - window + 1 .. p only.

    query [T, H, D] is the step's flat batch; request r owns rows
    query_start_loc[r] .. query_start_loc[r + 1] (R + 1 entries, absolute rows, so a slice
    such as metadata.query_start_loc[num_decodes:] works) and has seq_lens[r] tokens of
    context after the step, all of whose K/V are already in kv_cache [N, 2, block_size, KV, D].
    block_tables is [R, max_blocks]; max_query_len bounds the requests' query lengths. Returns
    `out` ([T, H, D], allocated when None) with those rows written; other rows are untouched.
    """
    group = _check_prefill_args(query, kv_cache, query_start_loc, seq_lens, block_tables)
    head_dim = query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_reqs == 0 or max_query_len <= 0:
        return out

    cfg = prefill_config(query, group)
    operand_dtype = dot_dtype(query)
    block_q = cfg.block_rows // group
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        query,
        out,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        window,
        softcap,
        *query.stride(),
        *out.stride(),
        *kv_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        D_PAD=pow2_at_least(head_dim, dot_floor(query)),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q,
        BLOCK_ROWS=cfg.block_rows,
        BLOCK_N=cfg.block_n,
        DOT_DTYPE=operand_dtype,
        PRECISION=dot_precision(operand_dtype),
        SOFTCAP=softcap > 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
