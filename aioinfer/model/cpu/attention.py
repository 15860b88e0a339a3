"""The CPU attention backend: decodes by the native paged kernel, everything else as torch.

Decode steps dominate serving on the CPU, and the torch reference spends most of their attention
time gathering every request's K/V into a padded copy; the native kernel reads the cache in place
through the block table (kernels.c). A whole prompt attends over its own new keys and values
without reading them back (SDPA); a chunk after a cached prefix, a sliding window shorter than
the prompt and soft-capped scores take the native prefill kernel, as every prompt chunk of the
native decoder layers (layers.py) does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aioinfer.model.cpu.kernels import NativeKernels
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
        softcap: float = 0.0,
    ) -> torch.Tensor:
        nd = query.shape[0]
        tables, seq_lens = metadata.block_tables[:nd], metadata.seq_lens[:nd]
        return self.kernels.paged_decode_attention(
            query, kv_cache, tables, seq_lens, scale, window, softcap
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
        softcap: float = 0.0,
    ) -> torch.Tensor:
        tokens = query.shape[0]
        if metadata.seq_lens_host[i] > tokens or 0 < window < tokens or softcap:
            # A cached prefix, a window inside the prompt or soft-capped scores: the native
            # prefill kernel, which reads the context from the cache through the block table.
            starts = torch.tensor([0, tokens], dtype=torch.int32)
            return self.kernels.paged_prefill_attention(
                query, kv_cache, metadata.block_tables[i : i + 1], starts,
                metadata.seq_lens[i : i + 1], scale, window, softcap,
            )  # fmt: skip
        # A whole prompt: its keys and values are these tensors, no gather from the cache.
        # [1, heads, L, D]: batched 4-D inputs take SDPA's flash kernel on the CPU.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
