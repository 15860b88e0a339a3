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

import array
import itertools
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
        """Metadata for requests fed `query_lens[i]` tokens after `context_lens_before[i]`.

        Built from Python lists, two tensors in all (one per dtype): a step's metadata is
        small, and each torch op on it costs more to dispatch than to run."""
        _check_build_args(query_lens, context_lens_before, block_tables, block_size)
        qsl = [0, *itertools.accumulate(query_lens)]
        seq_lens = [q + c for q, c in zip(query_lens, context_lens_before, strict=True)]
        positions: list[int] = []
        slots: list[int] = []
        for q, start, table in zip(query_lens, context_lens_before, block_tables, strict=True):
            if q == 1:  # a decode: the common case, kept cheap
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
                continue
            span = range(start, start + q)
            positions += span
            slots += [table[p // block_size] * block_size + p % block_size for p in span]
        num_reqs = len(query_lens)
        num_decodes = 0
        while num_decodes < num_reqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        # array.array converts a list in C; torch.tensor of a list goes element by element.
        longs_host = array.array("q", positions)
        longs_host.extend(slots)
        ints_host = array.array("i", qsl)
        ints_host.extend(seq_lens)
        width = max(len(t) for t in block_tables)
        padding = [0] * width
        for table in block_tables:  # padded with 0 to the widest
            ints_host.extend(table)
            if len(table) < width:
                ints_host.extend(padding[len(table) :])
        longs = torch.frombuffer(longs_host, dtype=torch.int64)
        ints = torch.frombuffer(ints_host, dtype=torch.int32)
        device = torch.device(device)
        if device.type == "cuda":
            longs, ints = to_device(longs, device), to_device(ints, device)
        num_tokens = len(positions)
        tables_end = 2 * num_reqs + 1 + num_reqs * width
        return AttentionMetadata(
            positions=longs[:num_tokens],
            slot_mapping=longs[num_tokens:],
            query_start_loc=ints[: num_reqs + 1],
            seq_lens=ints[num_reqs + 1 : 2 * num_reqs + 1],
            block_tables=ints[2 * num_reqs + 1 : tables_end].view(num_reqs, width),
            query_start_loc_host=tuple(qsl),
            seq_lens_host=tuple(seq_lens),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
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
