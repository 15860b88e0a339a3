"""Linear layers on the native CPU kernel: weights packed into 16-column strips at load time.

`pack_linears(model, kernels)` swaps every float32 `nn.Linear` whose out_features is a multiple
of 16 for a `PackedLinear` holding the packed copy only. A tied LM head gets its own packed copy;
the embedding keeps the row layout that lookups need.
"""

from __future__ import annotations

import torch
from torch import nn

from aioinfer.model.kernels.cpu_native import STRIP, NativeKernels, pack_weight, unpack_weight


class PackedLinear(nn.Module):
    """`y = x @ W^T + b` by the native kernel; same inputs and outputs as the nn.Linear it replaces."""

    def __init__(self, linear: nn.Linear, kernels: NativeKernels) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = nn.Parameter(pack_weight(linear.weight), requires_grad=False)
        self.bias = linear.bias
        self.kernels = kernels
        # State dicts keep Hugging Face's names and layout: `weight` [N, K], not the strips.
        self._register_state_dict_hook(_unpacked_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).contiguous()
        out = self.kernels.packed_linear(rows, self.packed, self.bias)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def _unpacked_state(
    module: PackedLinear, state: dict[str, torch.Tensor], prefix: str, _meta: object
) -> None:
    state[prefix + "weight"] = unpack_weight(state.pop(prefix + "packed"))


def can_pack(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Linear)
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.out_features % STRIP == 0
    )


def pack_linears(model: nn.Module, kernels: NativeKernels) -> int:
    """Replace the packable linears of `model` in place; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if can_pack(child):
                setattr(parent, name, PackedLinear(child, kernels))  # type: ignore[arg-type]
                replaced += 1
    return replaced
