"""Random weights with a checkpoint's real shapes, drawn directly on the target device.

Linear and embedding weights ~ N(0, 0.02) (the usual HF init), norm weights 1, biases 0, from a
generator seeded with `seed`, so one seed on one device always gives the same model.
"""

from __future__ import annotations

from collections.abc import Container, Iterator

import torch
from torch import nn

INIT_STD = 0.02


def iter_dummy(
    model: nn.Module, wanted: Container[str], dtype: torch.dtype, device: torch.device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, random tensor on `device` in `dtype`) for each parameter of `model` in `wanted`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, param in model.named_parameters():
        if name not in wanted:
            continue
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
        yield name, tensor
