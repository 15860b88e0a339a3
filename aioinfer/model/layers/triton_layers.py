"""The triton RMSNorm, SiLU-and-mul and rotary kernels as drop-in modules for a model on CUDA.

`use_triton_kernels(model)` swaps, in place, every `RMSNorm`, `SiluAndMul` and `ApplyRotary` for
a module that takes and returns the same tensors in one kernel launch (kernels/norm_act.py,
kernels/rotary.py), after checking each kernel once against its torch module on this device: a
kernel that fails to build or disagrees is left out, with a warning, and the torch module stays.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from aioinfer.model.kernels import norm_act, rotary
from aioinfer.model.layers.activation import SiluAndMul
from aioinfer.model.layers.norm import RMSNorm
from aioinfer.model.layers.rotary import ApplyRotary

logger = logging.getLogger(__name__)


class TritonRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm) -> None:
        nn.Module.__init__(self)  # adopts the norm's weight: state dicts are unchanged
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_act.rms_norm(x, self.weight, self.eps)


class TritonSiluAndMul(SiluAndMul):
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.dim() > 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
            return super().forward(gate, up)
        return norm_act.silu_and_mul(gate, up)


class TritonApplyRotary(ApplyRotary):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
            return super().forward(x, cos, sin)
        return rotary.apply_rotary(x, cos, sin)


def kernel_mismatch(module: nn.Module, twin: nn.Module, *inputs: torch.Tensor) -> str | None:
    """Why `twin` cannot stand in for `module` on these inputs (an error, or outputs that differ
    by more than rounding in the inputs' dtype), or None when it can."""
    try:
        got = twin(*(t.clone() for t in inputs))
    except Exception as exc:  # a kernel that does not build on this device, say
        return f"{type(exc).__name__}: {exc}"
    expected = module(*(t.clone() for t in inputs))
    tol = 1e-5 if expected.dtype == torch.float32 else 2e-2
    if not torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol):
        worst = (got.float() - expected.float()).abs().max().item()
        return f"outputs differ from torch's by up to {worst:.3g}"
    return None


def use_triton_kernels(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Swap the model's RMSNorm, SiluAndMul and ApplyRotary modules for the triton ones, each
    kind only if it matches torch on a sample here; returns how many modules were swapped."""
    gen = torch.Generator(device=device).manual_seed(0)
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    usable: dict[type, bool] = {}
    if norms:
        sample = norms[0]
        x = torch.randn(5, sample.weight.shape[0], generator=gen, device=device).to(dtype)
        usable[RMSNorm] = _usable("RMSNorm", kernel_mismatch(sample, TritonRMSNorm(sample), x))
    if any(type(m) is SiluAndMul for m in model.modules()):
        gate, up = torch.randn(2, 5, 96, generator=gen, device=device).to(dtype)
        mismatch = kernel_mismatch(SiluAndMul(), TritonSiluAndMul(), gate, up)
        usable[SiluAndMul] = _usable("SiluAndMul", mismatch)
    if any(type(m) is ApplyRotary for m in model.modules()):
        x = torch.randn(5, 3, 64, generator=gen, device=device).to(dtype)
        cos, sin = torch.randn(2, 5, 32, generator=gen, device=device).to(dtype)
        mismatch = kernel_mismatch(ApplyRotary(), TritonApplyRotary(), x, cos, sin)
        usable[ApplyRotary] = _usable("rotary", mismatch)

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            twin: nn.Module | None = None
            if type(child) is RMSNorm and usable.get(RMSNorm):
                twin = TritonRMSNorm(child)
            elif type(child) is SiluAndMul and usable.get(SiluAndMul):
                twin = TritonSiluAndMul()
            elif type(child) is ApplyRotary and usable.get(ApplyRotary):
                twin = TritonApplyRotary()
            if twin is not None:
                setattr(parent, name, twin)
                swapped += 1
    return swapped


def _usable(kind: str, mismatch: str | None) -> bool:
    if mismatch is not None:
        logger.warning("The triton %s kernel is not used on this device: %s", kind, mismatch)
    return mismatch is None
