"""LoRA adapters in PEFT's format, applied per request on top of the base model's linears.

An adapter is a folder with `adapter_config.json` (r, lora_alpha, target_modules, use_rslora)
and `adapter_model.safetensors`, whose keys name each adapted linear of the base model:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight    [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight    [out, r]

A token of a request with an adapter gets y = W x + scale * B (A x), with scale = alpha / r
(alpha / sqrt(r) with rsLoRA). `LoRAManager` wraps the decoder's projections (q, k, v, o,
gate, up, down) in `LoRALinear`s once, at start-up; each loaded adapter takes a slot (1, 2, ...;
0 is the base model; a slot is never reused) in every linear it adapts. The step's
`LoRAMapping` (which rows of the flat batch use which slot) reaches the linears through the
forward context; rows of one adapter are gathered and get their delta in two small GEMMs, so a
batch mixes adapters freely.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aioinfer.core.lora import LoRARequest
from aioinfer.model.forward_context import get_forward_context

# The linears an adapter may adapt, by the last part of their name.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAMapping:
    """One step's rows by adapter slot: (slot, row indices into the flat batch) for each slot
    that some row uses, slot 0 (no adapter) left out."""

    groups: tuple[tuple[int, torch.Tensor], ...]

    @staticmethod
    def build(slots_and_lengths: list[tuple[int, int]], device: torch.device) -> LoRAMapping:
        """From each chunk's (slot, number of tokens), in the order of the flat batch."""
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, length in slots_and_lengths:
            if slot:
                rows.setdefault(slot, []).extend(range(start, start + length))
            start += length
        return LoRAMapping(
            tuple(
                (slot, torch.tensor(index, dtype=torch.long).to(device))
                for slot, index in sorted(rows.items())
            )
        )


class LoRALinear(nn.Module):
    """`base(x)` plus each adapter's delta on the rows of the step that use it."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        # slot -> (A [r, in], B [out, r], scale)
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = get_forward_context().lora_mapping if self.adapters else None
        if mapping is None:
            return y
        for slot, rows in mapping.groups:
            adapter = self.adapters.get(slot)
            if adapter is None:  # this adapter leaves this linear alone
                continue
            a, b, scale = adapter
            delta = (x.index_select(0, rows) @ a.t()) @ b.t()
            y.index_add_(0, rows, delta, alpha=scale)
        return y


@dataclass(frozen=True)
class _Adapter:
    rank: int
    scale: float
    # linear name (model.layers.N.self_attn.q_proj) -> (A, B)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    """The model's LoRA-wrapped linears and the adapters loaded into them."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.slots: dict[str, int] = {}  # adapter name -> slot
        # Slots are never reused: the prefix cache roots an adapter's blocks at its slot.
        self._next_slot = 1
        self.linears: dict[str, LoRALinear] = {}
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if name in TARGETS and ".layers." in f".{parent_name}.":
                    wrapped = LoRALinear(child)
                    setattr(parent, name, wrapped)
                    self.linears[f"{parent_name}.{name}"] = wrapped

    def load(self, request: LoRARequest) -> int:
        """The adapter's slot, loading it into a new slot the first time its name is seen.
        ValueError naming what is wrong with the adapter or that no slot is left."""
        slot = self.slots.get(request.lora_name)
        if slot is not None:
            return slot
        if len(self.slots) >= self.max_loras:
            raise ValueError(
                f"cannot load LoRA adapter {request.lora_name!r}: all {self.max_loras} slots "
                "are taken (--max-loras)"
            )
        adapter = read_adapter(Path(request.lora_path), set(self.linears))
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}, more than "
                f"--max-lora-rank {self.max_rank}"
            )
        for name, (a, b) in adapter.weights.items():
            base = self.linears[name].base
            want = (int(base.in_features), int(base.out_features))  # type: ignore[arg-type]
            if (a.shape[1], b.shape[0]) != want:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} adapts {name} as {a.shape[1]} -> "
                    f"{b.shape[0]} features, the model's is {want[0]} -> {want[1]}"
                )
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        for name, (a, b) in adapter.weights.items():
            linear = self.linears[name]
            device = _device_of(linear)
            linear.adapters[slot] = (
                a.to(device=device, dtype=self.dtype),
                b.to(device=device, dtype=self.dtype),
                adapter.scale,
            )
        self.slots[request.lora_name] = slot
        return slot

    def unload(self, name: str) -> None:
        """Drop an adapter's weights (no request may still use it); KeyError if not loaded."""
        slot = self.slots.pop(name)
        for linear in self.linears.values():
            linear.adapters.pop(slot, None)


def read_adapter(folder: Path, linears: set[str]) -> _Adapter:
    """A PEFT LoRA adapter's rank, scale and weights by linear name; ValueError for a folder
    that is not one, or adapts what the model cannot (embeddings, the LM head, DoRA)."""
    config_path = folder / "adapter_config.json"
    weights_path = folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(
            f"{folder} is not a LoRA adapter: it needs adapter_config.json and "
            "adapter_model.safetensors"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        assert isinstance(config, dict)
    except (ValueError, AssertionError):
        raise ValueError(f"{config_path} is not a JSON object") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{config_path}: peft_type must be LORA, got {config['peft_type']!r}")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ValueError(f"{config_path}: {key} is not supported")
    try:  # PEFT's defaults where the file leaves them out
        rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    except (TypeError, ValueError):
        raise ValueError(f"{config_path}: r and lora_alpha must be numbers") from None
    if rank < 1:
        raise ValueError(f"{config_path}: r must be >= 1, got {rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    from safetensors.torch import load_file

    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    # The file's keys decide what is adapted (target_modules only says what PEFT looked for).
    for key, tensor in tensors.items():
        plain = key.removeprefix(_PEFT_PREFIX).replace(".default.", ".")  # PEFT's adapter name
        name, dot, part = plain.rpartition(".lora_")
        if not dot or part not in ("A.weight", "B.weight"):
            raise ValueError(f"{weights_path}: {key} is not a LoRA A or B weight")
        if name not in linears:
            raise ValueError(
                f"{weights_path}: {key} adapts {name!r}, which is not one of the decoder's "
                f"projections ({', '.join(TARGETS)})"
            )
        pairs.setdefault(name, {})[part[0]] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise ValueError(
                f"{weights_path}: {name} needs lora_A [{rank}, in] and lora_B [out, {rank}]"
            )
        weights[name] = (pair["A"], pair["B"])
    if not weights:
        raise ValueError(f"{weights_path} holds no LoRA weights")
    return _Adapter(rank, scale, weights)


def _device_of(linear: LoRALinear) -> torch.device:
    tensor = next(iter(linear.base.parameters()), None)
    return tensor.device if tensor is not None else torch.device("cpu")
