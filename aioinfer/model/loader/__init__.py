"""Model loading: resolve a model argument, build the model on meta, assign its weights by name.

    resolved = resolve_model("Qwen/Qwen2.5-1.5B-Instruct")     # or a folder, a .gguf, ""
    model = load_model(resolved, resolve_dtype("auto", device), device, seed=0)

The model is built under `torch.device("meta")` (no memory), then each checkpoint tensor is read,
converted to the target dtype, moved to the device and put in place of its meta placeholder, one
tensor at a time, so no weight ever exists twice. A safetensors tensor that already has the target
dtype and device is the memory map of the file itself: it becomes the parameter without a copy.
A checkpoint key that names part of a parameter (one expert of a layer's stacked expert weights,
see the model's `checkpoint_slots`) is copied into that part of it. Afterwards every parameter
must be real.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from aioinfer.model.loader.resolve import (
    BUNDLED_CONFIGS,
    LOAD_FORMATS,
    bundled_gguf_path,
    resolve_model,
)
from aioinfer.model.loader.resolved import ResolvedModel
from aioinfer.model.loader.weight_names import (
    checkpoint_keys,
    checkpoint_slots,
    checkpoint_splits,
    skip_init,
    weight_targets,
)

if TYPE_CHECKING:
    from aioinfer.model.layers.moe import WeightSlot
    from aioinfer.model.llama import LlamaForCausalLM

__all__ = [
    "BUNDLED_CONFIGS",
    "DTYPES",
    "LOAD_FORMATS",
    "ResolvedModel",
    "bundled_gguf_path",
    "checkpoint_keys",
    "load_model",
    "load_weights",
    "resolve_dtype",
    "resolve_model",
    "set_tensor",
]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHOWN_MISSING = 20


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """ "auto" is bfloat16 on CUDA and float32 on the CPU; otherwise the dtype `name` names."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {('auto', *DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_model(
    resolved: ResolvedModel,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    pooling: bool = False,
) -> LlamaForCausalLM:
    """The registry's model class for `resolved.hf_config`, with its weights on `device`.
    `pooling`: for embeddings, without the LM head (neither read nor allocated)."""
    from aioinfer.core.pooling import is_classifier
    from aioinfer.model.loader.resolve import architecture_of
    from aioinfer.model.registry import get_model_class

    hf_config = resolved.hf_config
    model_cls = get_model_class(hf_config)
    architecture = architecture_of(hf_config)
    if not pooling and architecture.endswith("Model"):
        raise ValueError(
            f"architecture {architecture!r} is a decoder without an LM head: it makes "
            "embeddings (--runner pooling), not text"
        )
    with torch.device("meta"), skip_init():
        model = model_cls(hf_config)
        if is_classifier(architecture):
            model.add_classifier(int(hf_config.num_labels or 0))
    if pooling:
        model.drop_lm_head()
    load_weights(model, resolved, dtype, device, seed)
    return model


def load_weights(
    model: nn.Module,
    resolved: ResolvedModel,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> None:
    """Fill `model` (built on meta, names mirroring HF keys) from the checkpoint of `resolved`.

    Checkpoint keys the model lacks (e.g. `rotary_emb.inv_freq`) are skipped. Afterwards the
    model's `tie_weights()` and `init_buffers(device)` run if it has them, and a ValueError
    naming them is raised if any parameter or buffer is still on meta.
    """
    device = torch.device(device)
    start = time.perf_counter()
    targets = weight_targets(model, resolved.hf_config)
    slots, splits = checkpoint_slots(model), checkpoint_splits(model)
    parts: dict[str, set[str]] = {}  # stacked parameter -> the checkpoint keys copied into it
    count, nbytes = 0, 0
    wanted = targets.keys() | slots.keys() | splits.keys()
    for name, tensor in _weight_stream(model, resolved, wanted, dtype, device, seed):
        if name in splits:
            for value in _split(model, name, tensor, splits[name], targets, dtype, device):
                count += 1
                nbytes += value.numel() * value.element_size()
            continue
        slot = slots.get(name)
        if slot is not None and slot.expert is not None:
            value = _copy_into_slot(model, name, tensor, slot, targets[slot.target], dtype, device)
            parts.setdefault(slot.target, set()).add(name)
        else:
            target = name if slot is None else slot.target
            value = _convert(name, tensor, targets[target], dtype, device)
            set_tensor(model, target, value)
        count += 1
        nbytes += value.numel() * value.element_size()
    _check_parts_complete(slots, parts, _describe_source(resolved))
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    init_buffers = getattr(model, "init_buffers", None)
    if callable(init_buffers):
        init_buffers(device)
    _check_materialised(model, _describe_source(resolved))
    model.eval()
    logger.info(
        "loaded %d tensors (%.2f GiB, %s) from %s in %.1f s",
        count,
        nbytes / 2**30,
        str(dtype).removeprefix("torch."),
        _describe_source(resolved),
        time.perf_counter() - start,
    )


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter or buffer `name` (e.g. a meta placeholder)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    elif attr in module._buffers:
        setattr(module, attr, tensor)
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of {type(model).__name__}")


def _split(
    model: nn.Module,
    name: str,
    tensor: torch.Tensor,
    parts: list[tuple[str, int, int]],
    targets: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Cut a fused checkpoint tensor (Phi-3's qkv_proj) by rows into its parameters."""
    rows = sum(count for _, _, count in parts)
    if tensor.shape[0] != rows:
        raise ValueError(
            f"weight {name} has {tensor.shape[0]} rows in the checkpoint but the model's "
            f"{', '.join(target for target, _, _ in parts)} have {rows}; does config.json match "
            "the weights?"
        )
    values = []
    for target, start, count in parts:
        value = _convert(name, tensor[start : start + count], targets[target], dtype, device)
        set_tensor(model, target, value)
        values.append(value)
    return values


def _copy_into_slot(
    model: nn.Module,
    name: str,
    tensor: torch.Tensor,
    slot: WeightSlot,
    target: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Copy the checkpoint tensor `name` into its part of the stacked parameter `slot.target`
    (allocated, uninitialised, on its first part); returns that part."""
    stacked = model.get_parameter(slot.target)
    if stacked.is_meta:
        set_tensor(model, slot.target, torch.empty(target.shape, dtype=dtype, device=device))
        stacked = model.get_parameter(slot.target)
    assert slot.expert is not None
    part = stacked[slot.expert]
    if slot.rows is not None:
        part = part[slot.row : slot.row + slot.rows]
    if tensor.shape != part.shape:
        raise ValueError(
            f"weight {name} has shape {tuple(tensor.shape)} in the checkpoint but its part of "
            f"{slot.target} has {tuple(part.shape)}; does config.json match the weights?"
        )
    part.copy_(tensor)
    return part


def _check_parts_complete(
    slots: dict[str, WeightSlot], parts: dict[str, set[str]], source: str
) -> None:
    """A stacked parameter that received some of its parts must have received all of them: the
    rest would be uninitialised memory."""
    missing = [
        name
        for name, slot in slots.items()
        if slot.target in parts and slot.expert is not None and name not in parts[slot.target]
    ]
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} weight(s) the model needs: {_listing(missing)}"
        )


def _weight_stream(
    model: nn.Module,
    resolved: ResolvedModel,
    targets: Collection[str],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    if resolved.kind == "dummy":
        from aioinfer.model.loader.dummy import iter_dummy

        return iter_dummy(model, targets, dtype, device, seed)
    if resolved.kind == "gguf":
        from aioinfer.model.loader.gguf_loader import iter_gguf

        reader, resolved.gguf_reader = resolved.gguf_reader, None
        if reader is None:
            from aioinfer.model.loader.gguf_config import open_gguf

            if resolved.gguf_file is None:
                raise ValueError("a model of kind 'gguf' needs its gguf_file")
            reader = open_gguf(resolved.gguf_file)
        return iter_gguf(reader, resolved.hf_config, targets)
    from aioinfer.model.loader.safetensors_loader import iter_safetensors

    return iter_safetensors(resolved.folder, targets)


def _convert(
    name: str,
    tensor: torch.Tensor,
    target: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    if tensor.shape != target.shape:
        raise ValueError(
            f"weight {name} has shape {tuple(tensor.shape)} in the checkpoint but "
            f"{tuple(target.shape)} in the model; does config.json match the weights?"
        )
    # `to` returns `tensor` itself when nothing changes: a memory-mapped tensor stays mapped.
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


def _check_materialised(model: nn.Module, source: str) -> None:
    persistent = model.state_dict(keep_vars=True)
    missing = [name for name, tensor in persistent.items() if tensor.is_meta]
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} weight(s) the model needs: {_listing(missing)}"
        )
    buffers = [name for name, b in model.named_buffers(remove_duplicate=False) if b.is_meta]
    if buffers:
        raise ValueError(
            f"buffers still on the meta device after loading: {_listing(buffers)}; "
            f"{type(model).__name__} must rebuild them in an init_buffers(device) method"
        )


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_MISSING])
    more = len(names) - _SHOWN_MISSING
    return f"{shown} and {more} more" if more > 0 else shown


def _describe_source(resolved: ResolvedModel) -> str:
    if resolved.kind == "dummy":
        return "random weights"
    if resolved.kind == "gguf":
        return str(resolved.gguf_file)
    if resolved.converted_from is not None:
        return f"{resolved.folder} (converted from {resolved.converted_from.name})"
    return str(resolved.folder)
