"""Which names a checkpoint fills in a model built on meta: its parameters and persistent buffers
(a tied LM head left out), the per-expert keys of stacked expert weights (the model's
`checkpoint_slots`) and the parts of fused tensors (`checkpoint_splits`); and the model built on
meta without running torch's initializers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from aioinfer.model.layers.moe import WeightSlot


def checkpoint_keys(hf_config: Any) -> set[str]:
    """The checkpoint keys the registry's model for `hf_config` reads (a tied head left out)."""
    from aioinfer.model.registry import get_model_class

    with torch.device("meta"), skip_init():
        model = get_model_class(hf_config)(hf_config)
    slots, splits = checkpoint_slots(model), checkpoint_splits(model)
    filled = {slot.target for slot in slots.values()}
    filled |= {target for parts in splits.values() for target, _, _ in parts}
    return (set(weight_targets(model, hf_config)) - filled) | set(slots) | set(splits)


@contextmanager
def skip_init() -> Iterator[None]:
    """Turn `torch.nn.init`'s in-place initializers into no-ops while a model is built on meta.

    The values are replaced by the checkpoint anyway, and on meta these ops run Python
    decompositions that import torch._dynamo: about 2 s of start-up for nothing. The patch is
    process-wide while it lasts (as transformers' `no_init_weights`): only the thread that loads
    the model builds modules meanwhile.
    """
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(torch.nn.init, name, init)


def _unchanged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def weight_targets(model: nn.Module, hf_config: Any) -> dict[str, torch.Tensor]:
    """Every name a checkpoint should fill: parameters and persistent buffers, aliases included.

    A tied LM head is left out: `tie_weights()` shares the embedding, so reading it is waste.
    """
    targets = dict(model.state_dict(keep_vars=True))
    if getattr(hf_config, "tie_word_embeddings", False):
        targets.pop("lm_head.weight", None)
    return targets


def checkpoint_slots(model: nn.Module) -> dict[str, WeightSlot]:
    slots = getattr(model, "checkpoint_slots", None)
    return slots() if callable(slots) else {}


def checkpoint_splits(model: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    splits = getattr(model, "checkpoint_splits", None)
    return splits() if callable(splits) else {}
