"""Rotary position embedding (the "rotate half" layout of Hugging Face checkpoints).

Supported scalings: none ("default"), "linear" and "llama3". The inverse frequencies are computed
on the CPU at construction, even under `torch.device("meta")`, and copied to the device of the
positions on first use, so a model built on meta and loaded later needs no extra set-up step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # Scaling parameters as named in the HF config (factor, low_freq_factor, ...).
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, name: str) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        raise ValueError(f"rope_scaling of type {self.rope_type!r} needs {name!r}")


def rope_config_from_hf(hf_config: Any, default_theta: float = 10000.0) -> RopeConfig:
    """Read rope settings from `rope_parameters` (transformers 5) or `rope_scaling`/`rope_theta`."""
    merged: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(hf_config, name, None)
        if isinstance(value, Mapping):
            merged.update(value)
    theta = merged.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    return RopeConfig(
        theta=float(theta or default_theta),
        rope_type=rope_type,
        params=tuple(sorted(merged.items())),
    )


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = float(rope.param("factor"))
    low_freq_factor = float(rope.param("low_freq_factor"))
    high_freq_factor = float(rope.param("high_freq_factor"))
    old_context_len = float(rope.param("original_max_position_embeddings"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / float(rope.param("factor"))
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin), each [T, head_dim // 2], for `apply_rotary`."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        # A plain attribute, not a buffer: `to_empty()` and state dicts leave it alone.
        self._inv_freq_cpu = compute_inv_freq(head_dim, rope)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        inv_freq = self._inv_freq_by_device.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = inv_freq
        return inv_freq

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Both halves of the rotated dims share these frequencies: only one half is kept.
        freqs = positions.float()[:, None] * self._inv_freq(positions.device)[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.rope.theta}, type={self.rope.rope_type}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, head_dim // 2] ("rotate half" layout).

    The same arithmetic as Hugging Face's `x * cos + rotate_half(x) * sin`, whose cos and sin
    repeat the same half twice, with half the multiplications.
    """
    half = x.shape[-1] // 2
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class ApplyRotary(nn.Module):
    """`apply_rotary` as a module, so the CPU and CUDA paths can swap in their kernels."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin)
