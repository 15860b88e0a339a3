"""Store a step's new K/V into the paged KV cache by slot mapping.

One program per new token copies its [num_kv_heads, head_dim] key and value to

    kv_cache[slot // block_size, 0 (K) / 1 (V), slot % block_size, :, :]

A negative slot marks a padding token (e.g. a CUDA-graph batch filled up to its captured size):
its program writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aioinfer.model.kernels.common import check_kv_cache, pow2_at_least


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, KV_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + h[:, None] * stride_ch
        + d[None, :] * stride_cd
    )
    elem = cache_ptr.dtype.element_ty
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask)
    v = tl.load(
        value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask
    )
    tl.store(dst, k.to(elem), mask)
    tl.store(dst + stride_ckv, v.to(elem), mask)


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, KV, D] to kv_cache [N, 2, block_size, KV, D] at slots [T] (in place).

    key and value may be strided views (e.g. slices of a fused QKV output); values are cast to
    the cache's dtype. Slots < 0 are skipped.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [T, KV, D], got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    check_kv_cache(kv_cache, num_kv_heads, head_dim)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be [{num_tokens}] (one slot per token), "
            f"got {tuple(slot_mapping.shape)}"
        )
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        KV_PAD=pow2_at_least(num_kv_heads, 1),
        D_PAD=pow2_at_least(head_dim, 1),
    )
