"""The CPU attention backend: decodes by the native paged kernel, everything else as torch.

Decode steps dominate serving on the CPU, and the torch reference spends most of their attention
time gathering every request's K/V into a padded copy; the native kernel reads the cache in place
through the block table (cpu_kernels.c). A whole prompt attends over its own new keys and values
without reading them back; a chunk after a cached prefix keeps the torch path. Native decoder
layers (native_cpu.py) run prompt chunks through the native prefill kernel instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aioinfer.model.kernels.cpu_native import NativeKernels
from aioinfer.model.layers.torch_attention import TorchAttentionBackend

if TYPE_CHECKING:
    from aioinfer.model.layers.attention import AttentionMetadata


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the native decode kernel handles this attention shape."""
    return (
        dtype == torch.float32
        and head_dim % 16 == 0
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
    )


class NativeAttentionBackend(TorchAttentionBackend):
    name = "native"

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        nd = query.shape[0]
        return self.kernels.paged_decode_attention(
            query, kv_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd], scale, window
        )

    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        i: int,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        # A cached prefix (read it from the cache), or a window inside the prompt: the torch path.
        if metadata.seq_lens_host[i] > query.shape[0] or 0 < window < query.shape[0]:
            return super().prefill(query, key, value, kv_cache, metadata, i, scale, window)
        # A whole prompt: its keys and values are these tensors, no gather from the cache.
        # [1, heads, L, D]: batched 4-D inputs take SDPA's flash kernel on the CPU.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
