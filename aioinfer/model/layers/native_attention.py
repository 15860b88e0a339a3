"""The CPU attention backend: decodes by the native paged kernel, everything else as torch.

Decode steps dominate serving on the CPU, and the torch reference spends most of their attention
time gathering every request's K/V into a padded copy; the native kernel reads the cache in place
through the block table (cpu_kernels.c). Prefill chunks keep the torch path, whose time goes to
SDPA's GEMMs rather than the gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aioinfer.model.kernels.cpu_native import NativeKernels
from aioinfer.model.layers.torch_attention import TorchAttentionBackend

if TYPE_CHECKING:
    from aioinfer.model.layers.attention import AttentionMetadata


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the native decode kernel handles this attention shape."""
    return dtype == torch.float32 and head_dim % 16 == 0 and num_heads % num_kv_heads == 0


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
    ) -> torch.Tensor:
        nd = query.shape[0]
        return self.kernels.paged_decode_attention(
            query, kv_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd], scale
        )
