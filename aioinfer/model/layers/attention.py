"""Paged attention: per-step metadata, the backend interface and the attention layer.

A step's tokens are one flat batch, requests back to back; decode requests (one query token)
should come first so backends can batch them. With block size 4, a request whose 6 tokens were
computed before and which feeds 3 new ones:

    query_start_loc  [0, ..., s, s+3, ...]      its tokens are query[s : s+3]
    seq_lens         [..., 9, ...]              context after the step = 6 + 3
    block_tables     [..., [7, 2, 9, 0], ...]   padded with 0; positions 4i..4i+3 -> block i
    slot_mapping     [..., 30, 31, 8, ...]      block_tables[p // 4] * 4 + p % 4 for p = 6, 7, 8
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from aioinfer.model.forward_context import get_forward_context
from aioinfer.model.layers.torch_attention import TorchAttentionBackend


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's KV cache; index 0 of dim 1 holds K, index 1 holds V."""
    return (num_blocks, 2, block_size, num_kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where a step's tokens sit in the flat batch and in the paged KV cache."""

    # [T] int64: each token's position in its sequence (rotary embeddings read it too).
    positions: torch.Tensor
    # [T] int64: flat cache slot (block * block_size + offset) receiving each new token's K/V.
    slot_mapping: torch.Tensor
    # [B + 1] int32: cumulative query lengths; request i owns tokens [qsl[i], qsl[i+1]).
    query_start_loc: torch.Tensor
    # [B] int32: context length after this step (tokens computed before + new tokens).
    seq_lens: torch.Tensor
    # [B, max_blocks] int32: each request's KV blocks in logical order, padded with 0.
    block_tables: torch.Tensor
    # Host copies of query_start_loc and seq_lens, so backends slice without a device sync.
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # How many leading requests have exactly one query token (batched as decodes).
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # [T] bool: the tokens that turn with LongRoPE's long factors (their request is longer than
    # the original context); None when no token of the step does.
    long_rope_rows: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_reqs

    @staticmethod
    def build(
        query_lens: Sequence[int],
        context_lens_before: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for requests fed `query_lens[i]` tokens after `context_lens_before[i]`."""
        _check_build_args(query_lens, context_lens_before, block_tables, block_size)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        ctx_lens = torch.tensor(context_lens_before, dtype=torch.int64)
        seq_lens = q_lens + ctx_lens
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        tables = _pad_block_tables(block_tables)

        # Token t of request r sits at position ctx_lens[r] + (t - qsl[r]).
        req_of_token = request_of_token(q_lens)
        positions = torch.arange(int(qsl[-1])) - qsl[req_of_token] + ctx_lens[req_of_token]
        blocks = tables[req_of_token, positions // block_size].to(torch.int64)
        slot_mapping = blocks * block_size + positions % block_size

        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        seq_lens_host = tuple(int(s) for s in seq_lens.tolist())
        device = torch.device(device)
        positions, slot_mapping = upload([positions, slot_mapping], device)
        qsl_device, seq_lens_device, tables = upload(
            [qsl.to(torch.int32), seq_lens.to(torch.int32), tables], device
        )
        return AttentionMetadata(
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=qsl_device,
            seq_lens=seq_lens_device,
            block_tables=tables,
            query_start_loc_host=tuple(int(s) for s in qsl.tolist()),
            seq_lens_host=seq_lens_host,
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens_host),
        )


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`. To a GPU through pinned memory and without blocking: a plain copy
    from pageable memory waits until the device has run everything queued before it."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device`; to a GPU in one copy (see to_device)."""
    if device.type != "cuda":
        return [p.to(device) for p in parts]
    flat = to_device(torch.cat([p.reshape(-1) for p in parts]), device)
    pieces = flat.split([p.numel() for p in parts])
    return [piece.view(p.shape) for piece, p in zip(pieces, parts, strict=True)]


def request_of_token(query_lens: torch.Tensor) -> torch.Tensor:
    """[T] int64: the request each token of the flat batch belongs to, from query_lens [B]."""
    return torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)


def _check_build_args(
    query_lens: Sequence[int],
    context_lens_before: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if not query_lens:
        raise ValueError("query_lens must name at least one request")
    if not len(query_lens) == len(context_lens_before) == len(block_tables):
        raise ValueError(
            "query_lens, context_lens_before and block_tables must have one entry per request, "
            f"got {len(query_lens)}, {len(context_lens_before)}, {len(block_tables)}"
        )
    for i, (q, ctx, table) in enumerate(
        zip(query_lens, context_lens_before, block_tables, strict=True)
    ):
        if q <= 0:
            raise ValueError(f"query_lens[{i}] must be > 0, got {q}")
        if ctx < 0:
            raise ValueError(f"context_lens_before[{i}] must be >= 0, got {ctx}")
        if len(table) * block_size < q + ctx:
            raise ValueError(
                f"block_tables[{i}] holds {len(table)} blocks of {block_size}, "
                f"too few for {q + ctx} tokens"
            )


def _pad_block_tables(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    width = max(len(t) for t in block_tables)
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return torch.tensor(padded, dtype=torch.int32)


class AttentionBackend(Protocol):
    """Writes a step's new K/V into the paged cache, then attends over each request's context."""

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
        """query [T, H, D], key/value [T, KV, D] -> [T, H, D]; mutates kv_cache in place. With
        a sliding `window`, a query at position p attends to keys p - window + 1 .. p only; with
        a `softcap`, scores become softcap * tanh(score / softcap) (Gemma 2)."""
        ...


_TORCH_BACKEND = TorchAttentionBackend()


class Attention(nn.Module):
    """Causal self-attention of one layer over its paged KV cache; holds no parameters."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window  # sliding window in tokens, or 0 for none
        self.softcap = softcap  # soft cap of the scores, or 0 for none

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [T, H, D], key/value [T, KV, D] -> [T, H, D]."""
        ctx = get_forward_context()
        backend = ctx.attn_backend or _TORCH_BACKEND
        kv_cache = ctx.kv_caches[self.layer_idx]
        return backend.forward(
            query, key, value, kv_cache, ctx.attn_metadata, self.scale, self.window, self.softcap
        )

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            + (f", window={self.window}" if self.window else "")
            + (f", softcap={self.softcap}" if self.softcap else "")
        )
