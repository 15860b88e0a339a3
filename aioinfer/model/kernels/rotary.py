"""The rotary embedding ("rotate half" layout) as one triton kernel, for the GPU path.

`apply_rotary` in torch is seven elementwise kernels (four products, a difference, a sum and a
concatenation), twice per layer for queries and keys: at decode sizes about half of a CUDA-graph
step's launches. One program rotates every head of one token.

It rounds where the torch function rounds, so that they agree:
    out = (to_dtype(x1 c) - to_dtype(x2 s), to_dtype(x2 c) + to_dtype(x1 s)), each in dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    stride_cos,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < HEADS) & (dims < HALF)
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    first = x_ptr + token * stride_x_token + heads * stride_x_head + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    out = out_ptr + token * stride_out_token + heads * stride_out_head + dims
    tl.store(out, out1.to(dtype), mask=mask)
    tl.store(out + HALF, out2.to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (head_dim of unit stride) rotated by cos/sin [T, head_dim // 2]
    (rows of unit stride) into a new contiguous tensor, as layers/rotary.py's `apply_rotary`."""
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if head_dim % 2 or cos.shape != (tokens, half) or sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must have shape ({tokens}, {half}) for x of shape {tuple(x.shape)}, "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("x, cos and sin must have unit stride in their last dimension")
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            cos.stride(0), HEADS=heads, HALF=half, BLOCK_HEADS=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )  # fmt: skip
    return out
