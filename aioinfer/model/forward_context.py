"""Per-step attention metadata and KV caches, scoped to one forward pass.

The runner wraps each forward in `with forward_context(metadata, kv_caches): ...`; attention layers
read it with `get_forward_context()`. The value lives in a ContextVar, so it is visible only to the
thread that entered the `with` and is gone once the block exits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from aioinfer.model.layers.attention import AttentionBackend, AttentionMetadata
    from aioinfer.model.lora import LoRAMapping


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """What every attention layer needs during one forward pass."""

    attn_metadata: AttentionMetadata
    # One tensor per layer, [num_blocks, 2, block_size, num_kv_heads, head_dim]; K at 0, V at 1.
    kv_caches: Sequence[torch.Tensor]
    # None selects the torch reference backend.
    attn_backend: AttentionBackend | None = None
    # Which rows use which LoRA adapter (model/lora.py); None when no row uses one.
    lora_mapping: LoRAMapping | None = None


_current: ContextVar[ForwardContext | None] = ContextVar("aioinfer_forward_context", default=None)


@contextmanager
def forward_context(
    attn_metadata: AttentionMetadata,
    kv_caches: Sequence[torch.Tensor],
    attn_backend: AttentionBackend | None = None,
    lora_mapping: LoRAMapping | None = None,
) -> Iterator[ForwardContext]:
    """Make `attn_metadata` and `kv_caches` visible to attention layers inside the block."""
    ctx = ForwardContext(attn_metadata, kv_caches, attn_backend, lora_mapping)
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    """The innermost active context; RuntimeError outside a `forward_context` block."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("attention ran outside `with forward_context(...)`")
    return ctx
