"""The triton attention backend: paged kernels that read the block table directly.

Per layer and step: store the new K/V by slot mapping, then one split-K decode launch for the
leading one-token requests and one prefill launch for all other requests (chunked prefill and
prefix-cache hits included). A decode-only step makes no host syncs and its launch grids depend
only on the batch shape, so it can be captured in a CUDA graph. On the CPU the same kernels run
under TRITON_INTERPRET=1 (set before the first import of this module), which is how tests check
them against the torch reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aioinfer.model.kernels.paged_decode import paged_decode_attention
from aioinfer.model.kernels.paged_prefill import paged_prefill_attention
from aioinfer.model.kernels.store_kv import store_kv_cache

if TYPE_CHECKING:
    from aioinfer.model.layers.attention import AttentionMetadata


class TritonAttentionBackend:
    """Paged attention in triton kernels; CUDA, or the CPU under TRITON_INTERPRET=1."""

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, KV, D] -> [T, H, D]; writes key/value into kv_cache."""
        store_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = metadata.num_decodes
        if nd > 0:
            paged_decode_attention(
                query[:nd],
                kv_cache,
                metadata.block_tables[:nd],
                metadata.seq_lens[:nd],
                scale,
                out=out[:nd],
                window=window,
                softcap=softcap,
            )
        if nd < metadata.num_reqs:
            paged_prefill_attention(
                query,
                kv_cache,
                metadata.query_start_loc[nd:],
                metadata.seq_lens[nd:],
                metadata.block_tables[nd:],
                metadata.max_query_len,
                scale,
                out=out,
                window=window,
                softcap=softcap,
            )
        return out
