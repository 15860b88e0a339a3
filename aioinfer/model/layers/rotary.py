"""Rotary position embedding (the "rotate half" layout of Hugging Face checkpoints).

Supported scalings: none ("default"), "linear", "llama3", "yarn" (Qwen's long-context setting)
and "longrope" (Phi-3's: short factors for a sequence within the original context, long factors
for every token of one past it; the scheduler decides per request and marks the tokens, see
`long_rows`). YaRN's and LongRoPE's attention factors scale cos and sin, as in transformers.
The inverse frequencies are computed on the CPU at construction, even under
`torch.device("meta")`, and copied to the device of the positions on first use, so a model
built on meta and loaded later needs no extra set-up step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # Scaling parameters as named in the HF config (factor, low_freq_factor, ...).
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, name: str, default: Any = None) -> Any:
        """The scaling parameter `name`; without it, `default`, else a ValueError."""
        for key, value in self.params:
            if key == name and value is not None:
                return value
        if default is not None:
            return default
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
    if rope_type in ("yarn", "longrope"):
        original = merged.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        merged["original_max_position_embeddings"] = original
        context = getattr(hf_config, "max_position_embeddings", None)
        if merged.get("factor") is None and original and context:
            # As transformers: the ratio of the context to the original one.
            merged["factor"] = float(context) / float(original)
    merged.pop("partial_rotary_factor", None)  # the model checks it (full rotary only)
    return RopeConfig(
        theta=float(theta or default_theta),
        rope_type=rope_type,
        params=tuple(
            sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in merged.items())
        ),
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


def _yarn_scale(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: divide the low frequencies by `factor` (interpolation), keep the high ones
    (extrapolation), and ramp linearly between the dims that turn beta_slow and beta_fast
    times over the original context."""
    factor = float(rope.param("factor"))
    original = float(rope.param("original_max_position_embeddings"))
    beta_fast, beta_slow = float(rope.param("beta_fast", 32)), float(rope.param("beta_slow", 1))

    def dim_of(rotations: float) -> float:
        """The dim whose wavelength fits `rotations` times into the original context."""
        turns = math.log(original / (rotations * 2 * math.pi))
        return head_dim * turns / (2 * math.log(rope.theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rope.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor(rope: RopeConfig) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (1.0 for the other scalings):
    `attention_factor`, else YaRN's 0.1 ln(factor) + 1 (a ratio of two such terms when
    mscale and mscale_all_dim are set), LongRoPE's sqrt(1 + ln(factor) / ln(original))."""
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    explicit = rope.param("attention_factor", 0.0)
    if explicit:
        return float(explicit)
    factor = float(rope.param("factor"))
    if rope.rope_type == "longrope":
        original = float(rope.param("original_max_position_embeddings"))
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    m, m_all = float(rope.param("mscale", 0.0)), float(rope.param("mscale_all_dim", 0.0))
    return mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)


def compute_inv_freq(head_dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies on the CPU (`long`: LongRoPE's long factors
    instead of its short ones)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / float(rope.param("factor"))
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scale(inv_freq, head_dim, rope)
    if rope.rope_type == "longrope":
        name = "long_factor" if long else "short_factor"
        factors = torch.tensor(rope.param(name), dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope {name} must hold {head_dim // 2} values")
        return 1.0 / (factors * rope.theta**exponents)  # transformers' rounding
    return inv_freq


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin), each [T, head_dim // 2], for `apply_rotary`.

    A LongRoPE embedding takes `long_rows` too ([T] bool, or None for none): the tokens of
    requests past the original context, which turn with the long factors."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        # Plain attributes, not buffers: `to_empty()` and state dicts leave them alone.
        self._inv_freq_cpu = {False: compute_inv_freq(head_dim, rope)}
        if rope.rope_type == "longrope":
            self._inv_freq_cpu[True] = compute_inv_freq(head_dim, rope, long=True)
        self.attention_factor = attention_factor(rope)
        self._inv_freq_by_device: dict[tuple[torch.device, bool], torch.Tensor] = {}

    @property
    def has_long_factors(self) -> bool:
        return True in self._inv_freq_cpu

    def _inv_freq(self, device: torch.device, long: bool = False) -> torch.Tensor:
        inv_freq = self._inv_freq_by_device.get((device, long))
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu[long].to(device)
            self._inv_freq_by_device[device, long] = inv_freq
        return inv_freq

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, long_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Both halves of the rotated dims share these frequencies: only one half is kept.
        inv_freq = self._inv_freq(positions.device)[None, :]
        if long_rows is not None and self.has_long_factors:
            long_inv_freq = self._inv_freq(positions.device, long=True)[None, :]
            inv_freq = torch.where(long_rows[:, None], long_inv_freq, inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

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
