"""The native CPU kernels as drop-in modules, swapped into a loaded float32 model.

`use_native_kernels(model, kernels)` replaces, in place:
- every float32 `nn.Linear` whose out_features is a multiple of 16 by a `PackedLinear` that
  holds only the packed weight (an embedding tied to it then looks rows up in the packed weight);
- `RMSNorm`, `SiluAndMul` and `ApplyRotary` by one native call each instead of several torch
  ops, where their sizes fit the kernels.
Each replacement takes and returns what the module it replaces does, so the model code is the
same on every device.
"""

from __future__ import annotations

import torch
from torch import nn

from aioinfer.model.kernels.cpu_native import STRIP, NativeKernels, pack_weight, unpack_weight
from aioinfer.model.layers.activation import SiluAndMul
from aioinfer.model.layers.norm import RMSNorm
from aioinfer.model.layers.rotary import ApplyRotary


class PackedLinear(nn.Module):
    """`y = x @ W^T + b` by the native kernel, with the inputs and outputs of nn.Linear."""

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
    module: nn.Module, state: dict[str, torch.Tensor], prefix: str, _meta: object
) -> None:
    state[prefix + "weight"] = unpack_weight(state.pop(prefix + "packed"))


class PackedEmbedding(nn.Module):
    """The lookup of a tied embedding that reads the LM head's packed weight, so the two still
    share one tensor: row t of W is packed[t // 16, :, t % 16]."""

    def __init__(self, embedding: nn.Embedding, packed: nn.Parameter) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.packed = packed
        self._register_state_dict_hook(_unpacked_state)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed[ids // STRIP, :, ids % STRIP]


class NativeRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm, kernels: NativeKernels) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class NativeSiluAndMul(SiluAndMul):
    def __init__(self, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate, up)


class NativeApplyRotary(ApplyRotary):
    def __init__(self, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % (2 * STRIP):  # each half must fill whole 16-lane registers
            return super().forward(x, cos, sin)
        return self.kernels.rotary(x, cos, sin)


def _native_twin(module: nn.Module, kernels: NativeKernels) -> nn.Module | None:
    """The native replacement of one module, or None to keep it."""
    if type(module) is nn.Linear:  # not subclasses, which may read .weight themselves
        fits = module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
        return PackedLinear(module, kernels) if fits and module.out_features % STRIP == 0 else None
    if type(module) is RMSNorm:
        fits = module.weight.dtype == torch.float32 and module.weight.shape[0] % STRIP == 0
        return NativeRMSNorm(module, kernels) if fits else None
    if type(module) is SiluAndMul:
        return NativeSiluAndMul(kernels)
    if type(module) is ApplyRotary:
        return NativeApplyRotary(kernels)
    return None


def use_native_kernels(model: nn.Module, kernels: NativeKernels) -> int:
    """Swap the model's modules for their native twins in place; returns how many were swapped.
    The model must be float32 on the CPU. An embedding tied to a linear that gets packed reads
    the packed weight, so tied weights stay one tensor."""
    packed_by_weight: dict[int, nn.Parameter] = {}
    embeddings: list[tuple[nn.Module, str, nn.Embedding]] = []
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding):
                embeddings.append((parent, name, child))
            twin = _native_twin(child, kernels)
            if twin is not None:
                if isinstance(twin, PackedLinear):
                    packed_by_weight[id(child.weight)] = twin.packed
                setattr(parent, name, twin)
                swapped += 1
    for parent, name, embedding in embeddings:
        packed = packed_by_weight.get(id(embedding.weight))
        if packed is not None:
            setattr(parent, name, PackedEmbedding(embedding, packed))
            swapped += 1
    return swapped
