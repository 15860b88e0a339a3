"""Small helpers shared by the triton kernels' launchers: dtypes, padding and shape checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def on_cuda(tensor: torch.Tensor) -> bool:
    """CUDA tensors run compiled kernels; anything else runs under TRITON_INTERPRET=1."""
    return tensor.device.type == "cuda"


def dot_dtype(query: torch.Tensor) -> tl.dtype:
    """Operand dtype of `tl.dot`: the query's on CUDA, float32 elsewhere.

    The CPU interpreter keeps bfloat16 as raw uint16 bits and does no bfloat16 arithmetic, so
    there every operand is upcast right after its load (accumulation is float32 either way).
    """
    if query.dtype not in _TL_DTYPES:
        raise ValueError(
            f"query dtype must be one of {sorted(map(str, _TL_DTYPES))}, got {query.dtype}"
        )
    return _TL_DTYPES[query.dtype] if on_cuda(query) else tl.float32


def dot_precision(dtype: tl.dtype) -> str:
    """`tl.dot` input precision: exact float32 ("ieee", not TF32) for float32 operands.

    Half-precision operands ignore it; they keep the default so tensor cores stay in use.
    """
    return "ieee" if dtype == tl.float32 else "tf32"


def pow2_at_least(n: int, floor: int) -> int:
    """The next power of two >= max(n, floor); tl.arange needs powers of two."""
    return max(triton.next_power_of_2(n), floor)


def dot_floor(tensor: torch.Tensor) -> int:
    """Smallest tile side `tl.dot` accepts: 16 when compiled for a GPU, 1 when interpreted."""
    return 16 if on_cuda(tensor) else 1


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim]."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache holds {tuple(kv_cache.shape[3:])} (kv heads, head dim), "
            f"the inputs have {(num_kv_heads, head_dim)}"
        )


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (GQA group size)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads
