"""Mixture-of-experts MLP on the GPU: every expert's GEMMs in one launch per projection.

Each token picked top_k experts, which makes T x top_k (token, expert) rows. `align_by_expert`
sorts those rows by expert and pads each expert's run to a multiple of BLOCK_M, so that every
BLOCK_M-row tile belongs to one expert. With 3 experts, BLOCK_M 4 and rows routed 2, 0, 3 to
experts 0, 1, 2 (`-` is padding, which no program writes):

    sorted rows:  r r - - | r r r -      expert of each tile: 0, 2, then past the end
    tile:           0     |   1     | 2, 3 (empty: the grid is sized for the worst case,
                                      5 rows + 3 experts x 3 padding rows = 4 tiles)

`_expert_gemm_kernel` then multiplies each tile by its expert's weight. The grid depends only
on T, top_k and the number of experts, never on the routing, and no step reads a value back
to the host: a decode step with experts can be captured in a CUDA graph and replayed with other
routings. Accumulation is float32 (exact float32 `tl.dot` for float32 weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aioinfer.model.kernels.common import dot_dtype, dot_floor, dot_precision
from aioinfer.model.kernels.norm_act import silu_and_mul

BLOCK_N = 64
BLOCK_K = 32


def block_rows(num_rows: int) -> int:
    """BLOCK_M for `num_rows` (token, expert) rows: small tiles waste less padding at decode
    sizes, where most experts get a row or two; larger ones reuse each weight tile more."""
    return 16 if num_rows <= 1024 else 64


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (`t * top_k + j` for token t's j-th expert) sorted by expert, each expert's run
    padded to a multiple of `block_m` with the row count as a sentinel; the expert of each tile
    (`num_experts` past the last run); and the padded length, as a 1-element tensor.

    Sizes are the worst case (every expert's run padded), so none depends on the routing.
    """
    flat = ids.reshape(-1)
    num_rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    run_starts = counts.cumsum(0) - counts  # where each expert's rows start in sorted order
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(num_rows, device=ids.device) - run_starts[experts]
    capacity = num_rows + num_experts * (block_m - 1)
    sorted_rows = torch.full((capacity,), num_rows, dtype=torch.int64, device=ids.device)
    sorted_rows.scatter_(0, padded_ends[experts] - padded[experts] + rank, order)
    tile_starts = torch.arange(0, capacity, block_m, device=ids.device)
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    return sorted_rows, tile_experts, padded_ends[-1:]


@triton.jit
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_rows_ptr,
    tile_experts_ptr,
    padded_len_ptr,
    row_weights_ptr,
    num_rows,
    top_k,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROW_IS_TOKEN: tl.constexpr,
    SCALE_BY_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[row] = a[row's input] @ w[expert]^T for one BLOCK_M x BLOCK_N tile of sorted rows.
    The input of row t * top_k + j is token t (A_ROW_IS_TOKEN, the first projection) or the
    row itself (the second); SCALE_BY_WEIGHT multiplies by the row's routing weight."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(padded_len_ptr):
        return
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    a_rows = rows // top_k if A_ROW_IS_TOKEN else rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    w_tile = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_tile + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    if SCALE_BY_WEIGHT:
        acc *= tl.load(row_weights_ptr + rows, mask=valid, other=0.0)[:, None]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _expert_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    top_k: int,
    row_weights: torch.Tensor | None,
) -> None:
    sorted_rows, tile_experts, padded_len = alignment
    _, n, k = weight.shape
    dtype = dot_dtype(a)
    block_n = max(BLOCK_N, dot_floor(a))
    grid = (tile_experts.numel(), triton.cdiv(n, block_n))
    _expert_gemm_kernel[grid](
        a, weight, out, sorted_rows, tile_experts, padded_len,
        row_weights if row_weights is not None else out,
        out.shape[0], top_k, n, k,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        A_ROW_IS_TOKEN=row_weights is None, SCALE_BY_WEIGHT=row_weights is not None,
        DOT_DTYPE=dtype, PRECISION=dot_precision(dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """As `layers.moe.experts_by_loop`: x [T, H], gate_up [E, 2I, H], down [E, H, I], weights
    and ids [T, top_k] -> [T, H]. Weights and x contiguous in their last dimension."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_rows = num_tokens * top_k
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("x and the expert weights must be contiguous in their last dimension")
    block_m = max(block_rows(num_rows), dot_floor(x))
    alignment = align_by_expert(ids, gate_up.shape[0], block_m)
    inter = down.shape[2]
    gate_up_out = torch.empty((num_rows, 2 * inter), dtype=x.dtype, device=x.device)
    _expert_gemm(x, gate_up, gate_up_out, alignment, block_m, top_k, None)
    act = silu_and_mul(gate_up_out[:, :inter], gate_up_out[:, inter:])
    rows_out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    row_weights = weights.reshape(-1).float().contiguous()
    _expert_gemm(act, down, rows_out, alignment, block_m, top_k, row_weights)
    return rows_out.view(num_tokens, top_k, hidden).sum(dim=1)
