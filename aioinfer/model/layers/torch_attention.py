"""The torch reference attention backend over the paged KV cache; the oracle for other backends.

New K/V are scattered into the cache by slot mapping first, so every query reads its whole
context (cached prefix and this step's tokens) from the cache the same way:

- decodes (the leading requests with one query token) are gathered together into a padded
  [B, max_len, kv_heads, D] tensor with a length mask and attended in one SDPA call;
- every other request gathers its own context and runs SDPA with a causal mask shifted by its
  cached prefix: the query at position p attends to keys 0..p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from aioinfer.model.layers.attention import AttentionMetadata


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, KV, D] at flat slots [T] of kv_cache [N, 2, block_size, KV, D].

    Through the cache viewed as rows [N * 2 * block_size, KV, D]: slot = block * block_size +
    offset keeps its key in row block * 2 * block_size + offset = slot + block * block_size and
    its value block_size rows further. index_copy_ on rows is far cheaper than advanced indexing
    with two index tensors."""
    block_size = kv_cache.shape[2]
    rows = kv_cache.view(-1, *kv_cache.shape[-2:])
    key_rows = slot_mapping + (slot_mapping // block_size) * block_size
    rows.index_copy_(0, key_rows, key.to(kv_cache.dtype))
    rows.index_copy_(0, key_rows + block_size, value.to(kv_cache.dtype))


def _gather(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of blocks [..., nb] as [..., nb * block_size, KV, D] each, in dtype.

    K and V are gathered apart, each from its strided view of the cache, with index_select (far
    faster on the CPU than advanced indexing): each result is contiguous block after block, so
    merging the block and slot dims is a free view rather than another copy.
    """
    lead, nb = block_ids.shape[:-1], block_ids.shape[-1]
    flat_ids = block_ids.reshape(-1).to(torch.long)
    shape = (*lead, nb * kv_cache.shape[2], *kv_cache.shape[-2:])
    keys = kv_cache[:, 0].index_select(0, flat_ids).view(shape).to(dtype)
    values = kv_cache[:, 1].index_select(0, flat_ids).view(shape).to(dtype)
    return keys, values


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """SDPA of q [B, H, L, D] over k, v [B, KV, S, D] (GQA) where mask (broadcast to
    [B, H, L, S]) is True, causal when mask is None; with a `softcap` (Gemma 2) the scores
    become softcap * tanh(score / softcap) before the mask, which SDPA cannot do."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.float().softmax(-1).to(v.dtype), v)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    min_seq_len: int = 0,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per request: query [B, H, D] over seq_lens[b] cached tokens -> [B, H, D];
    with a sliding `window`, over the last `window` of them.

    `min_seq_len` (any lower bound of seq_lens) lets the padding clean-up skip the slots that
    every request uses. `softcap`: see `attend`."""
    num_blocks = _cdiv(max_seq_len, kv_cache.shape[2])
    keys, values = _gather(kv_cache, block_tables[:, :num_blocks], query.dtype)  # [B, L, KV, D]
    key_pos = torch.arange(keys.shape[1], device=keys.device)
    valid = key_pos < seq_lens[:, None]  # [B, L]
    # Slots past a request's length may hold anything, NaN included, and SDPA's mask does not
    # shield it (NaN scores, 0 * NaN values). The gathered tensors are fresh copies: zero in place,
    # past the shortest request only.
    invalid = ~valid[:, min_seq_len:, None, None]
    keys[:, min_seq_len:].masked_fill_(invalid, 0.0)
    values[:, min_seq_len:].masked_fill_(invalid, 0.0)
    out = attend(
        query.unsqueeze(2),  # [B, H, 1, D]
        keys.transpose(1, 2),  # [B, KV, L, D]
        values.transpose(1, 2),
        scale,
        (valid & (key_pos >= seq_lens[:, None] - window) if window else valid)[:, None, None, :],
        softcap,
    )
    return out.squeeze(2)


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The last L positions of a seq_len context: query [L, H, D] -> [L, H, D], causal.
    `softcap`: see `attend`.

    Query j sits at position prefix + j (prefix = seq_len - L) and sees keys 0 .. prefix + j
    (with a sliding `window`, only the last `window` of them):

        keys     0 1 2 3 4 5
        q0 (p=3) x x x x . .
        q1 (p=4) x x x x x .
        q2 (p=5) x x x x x x
    """
    num_blocks = _cdiv(seq_len, kv_cache.shape[2])
    keys, values = _gather(kv_cache, block_table[:num_blocks], query.dtype)
    keys, values = keys[:seq_len], values[:seq_len]  # [S, KV, D]
    q_len = query.shape[0]
    prefix = seq_len - q_len
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
    k = keys.transpose(0, 1).unsqueeze(0)  # [1, KV, S, D]
    v = values.transpose(0, 1).unsqueeze(0)
    if prefix == 0 and not window:
        out = attend(q, k, v, scale, softcap=softcap)
    else:
        device = query.device
        key_pos = torch.arange(seq_len, device=device)
        query_pos = torch.arange(prefix, seq_len, device=device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [L, S]
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        out = attend(q, k, v, scale, mask, softcap)
    return out.squeeze(0).transpose(0, 1)


class TorchAttentionBackend:
    """Reference paged attention in plain torch; runs on CPU and GPU."""

    name = "torch"

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
        write_kv_cache(kv_cache, key, value, metadata.slot_mapping)
        out = torch.empty_like(query)
        nd = metadata.num_decodes
        if nd > 0:
            decoded = self.decode(query[:nd], kv_cache, metadata, scale, window, softcap)
            out[:nd] = decoded.to(out.dtype)
        qsl = metadata.query_start_loc_host
        for i in range(nd, metadata.num_reqs):
            rows = slice(qsl[i], qsl[i + 1])
            out[rows] = self.prefill(
                query[rows], key[rows], value[rows], kv_cache, metadata, i, scale, window, softcap
            ).to(out.dtype)
        return out

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
        """Request i of metadata, whose new tokens are query/key/value [L, ...]; the reference
        reads every key, new ones included, back from the cache."""
        seq_len = metadata.seq_lens_host[i]
        table = metadata.block_tables[i]
        return prefill_attention(query, kv_cache, table, seq_len, scale, window, softcap)

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """The leading `len(query)` requests of metadata, one query token each."""
        nd = query.shape[0]
        return decode_attention(
            query,
            kv_cache,
            metadata.block_tables[:nd],
            metadata.seq_lens[:nd],
            max(metadata.seq_lens_host[:nd]),
            scale,
            min_seq_len=min(metadata.seq_lens_host[:nd]),
            window=window,
            softcap=softcap,
        )
