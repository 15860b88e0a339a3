"""RMSNorm and SiLU-and-mul as one triton kernel each, for the GPU path.

In torch each is a chain of elementwise kernels (RMSNorm: upcast, square, mean, add, rsqrt,
multiply, downcast, scale: eight launches, twice per layer). At decode sizes a CUDA-graph step
is a few hundred such tiny kernels, and their count, not their arithmetic, sets the step time.

Both round where the torch modules round, so that they agree with them:
    rms_norm:      y = weight * to_dtype(x32 * rsqrt(mean(x32^2) + eps))   (the product in dtype)
    silu_and_mul:  y = to_dtype(silu(gate32)) * up                         (the product in dtype)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_out,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / DIM + eps)
    dtype = out_ptr.dtype.element_ty
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, stride_gate, stride_up, cols, BLOCK: tl.constexpr):
    """One block of one row; the result goes into gate's buffer."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < cols
    gate_row = gate_ptr + row * stride_gate + offsets
    gate = tl.load(gate_row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + offsets, mask=mask, other=0.0).to(tl.float32)
    dtype = gate_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(gate_row, (silu * up).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (rows of unit stride); returns a new tensor of x's shape
    and dtype. weight [dim] in x's dtype."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must have shape ({dim},), got {tuple(weight.shape)}")
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], dim), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), eps,
            DIM=dim, BLOCK=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out.view(x.shape)


SILU_BLOCK = 1024


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, written into gate's buffer (as the torch module does); both of one shape
    and dtype, rows of unit stride, spaced as they may be (the halves of a merged gate/up
    output): 1-D, or 2-D."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and "
            f"{tuple(up.shape)} {up.dtype}"
        )
    if gate.dim() not in (1, 2) or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("gate and up must be 1-D or 2-D with rows of unit stride")
    rows, cols = (1, gate.shape[0]) if gate.dim() == 1 else gate.shape
    if rows and cols:
        grid = (rows, triton.cdiv(cols, SILU_BLOCK))
        stride_gate, stride_up = (0, 0) if gate.dim() == 1 else (gate.stride(0), up.stride(0))
        _silu_and_mul_kernel[grid](gate, up, stride_gate, stride_up, cols, BLOCK=SILU_BLOCK)
    return gate
