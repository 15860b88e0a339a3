"""Allowed-token bitmasks (core/constraints.py) applied to logits: -inf where a row's mask
leaves a token out. On the CPU a native kernel writes the -inf; elsewhere a byte-table lookup
turns the masks into an additive bias."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from aioinfer.model.cpu.kernels import NativeKernels


def apply_token_masks(
    logits: torch.Tensor,
    rows: torch.Tensor,
    masks: torch.Tensor,
    kernels: NativeKernels | None = None,
) -> None:
    """In place on logits [B, V] float32: row rows[r] keeps only the tokens masks[r] allows
    (int32 [R, ceil(V / 32)], bit t % 32 of word t // 32: token t)."""
    if kernels is not None:
        kernels.apply_token_bitmask(logits, rows, masks)
    else:
        logits.index_add_(0, rows, mask_bias(masks, logits.shape[1]))


# Byte value -> its 8 bits as logit biases (bit set: 0, allowed; clear: -inf), lowest bit first.
_BYTE_BITS = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
_BYTE_BIAS = torch.zeros(256, 8).masked_fill_(_BYTE_BITS == 0, float("-inf"))


@functools.cache
def _byte_bias(device: torch.device) -> torch.Tensor:
    """_BYTE_BIAS on `device`, copied there once: a copy per step would wait for the device."""
    return _BYTE_BIAS.to(device)


def mask_bias(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Int32 bitmasks [R, W] (bit i % 32 of word i // 32: token i) as logit biases [R,
    vocab_size]: 0 for allowed tokens, -inf for the others. A byte-table lookup: bit shifts
    and a masked fill over [R, V] took 7x longer (the CPU has a native kernel instead)."""
    table = _byte_bias(masks.device)
    as_bytes = masks.contiguous().view(torch.uint8).long()  # little-endian: low byte first
    return torch.nn.functional.embedding(as_bytes, table).flatten(-2)[..., :vocab_size]
