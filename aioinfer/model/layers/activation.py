"""The gated MLP activations, modules so the CPU path can swap in its native kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, in place in gate's buffer: at prefill sizes it is the largest activation."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate, inplace=True).mul_(up)


class GeluTanhAndMul(nn.Module):
    """gelu(gate) * up with gelu's tanh approximation (Gemma's `gelu_pytorch_tanh`)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh").mul_(up)
