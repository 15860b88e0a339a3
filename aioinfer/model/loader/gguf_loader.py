"""Stream the tensors of a GGUF checkpoint, dequantized and renamed to Hugging Face keys.

llama.cpp names tensors `token_embd.weight`, `blk.N.attn_q.weight`, `output_norm.weight`, ...;
gguf-py's own name table maps HF module names to those, so the mapping is read from it rather than
written out here. For the "llama" architecture llama.cpp also reorders the rows of each Q and K
head (it rotates interleaved pairs, HF rotates halves); that reordering is undone here. A mixture
of experts keeps each layer's experts stacked in one tensor per projection
(`blk.N.ffn_gate_exps.weight`, [experts, out, in]), which fills one HF key per expert.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map, quants
from gguf.quants import dequantize

# GGUF architectures whose Q/K rows llama.cpp permuted at conversion time.
_PERMUTED_QK_ARCHS = ("llama",)
# Tensors a model may carry that its config accounts for otherwise (gguf_config.gguf_hf_config
# reads Llama 3's RoPE factors from rope_freqs).
_READ_ELSEWHERE = ("rope_freqs.weight",)
# An HF module of one expert, "model.layers.0.mlp.experts.3.gate_proj": gguf-py names the
# stacked tensor after the module without the index.
_EXPERT_MODULE = re.compile(r"(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)")
# Qwen2-MoE's shared-expert gate: [1, hidden] in HF, a vector in llama.cpp's files.
_VECTOR_IN_GGUF = (".ffn_gate_inp_shexp.",)


def gguf_architecture(reader: GGUFReader) -> str:
    return str(reader.fields["general.architecture"].contents())


def gguf_to_hf_names(arch: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, list[str]]:
    """{gguf tensor name: the HF keys it fills} for each HF key gguf-py knows how to name: one
    key, or a stacked expert tensor's keys in expert order (one per expert)."""
    model_arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if model_arch is None:
        raise ValueError(f"GGUF architecture {arch!r} is unknown to the installed gguf package")
    name_map = get_tensor_name_map(model_arch, num_layers)
    out: dict[str, dict[int, str]] = {}
    for hf_name in sorted(hf_names):
        module, _, suffix = hf_name.rpartition(".")
        expert = _EXPERT_MODULE.fullmatch(module)
        if expert is not None:
            module = f"{expert['experts']}.{expert['proj']}"
        gguf_module = name_map.get_name(module)
        if gguf_module is not None:
            index = int(expert["index"]) if expert is not None else 0
            # Two names of one parameter (a checkpoint's and the model's) fill it alike.
            out.setdefault(f"{gguf_module}.{suffix}", {}).setdefault(index, hf_name)
    return {name: [keys[i] for i in sorted(keys)] for name, keys in out.items()}


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order: rows (head, dim/2, 2) back to (head, 2, dim/2)."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def gguf_names(reader: GGUFReader, hf_config: Any, wanted: Iterable[str]) -> dict[str, list[str]]:
    """{gguf tensor name: the HF keys it fills} for the tensors of `reader` that fill keys in
    `wanted` (several: a stacked expert tensor, see gguf_to_hf_names).

    A tensor the model has no place for (a variant of the architecture it does not know) or of
    a type that cannot be dequantized is a ValueError naming it, before any tensor is read."""
    arch = gguf_architecture(reader)
    wanted = set(wanted)
    names = gguf_to_hf_names(arch, int(hf_config.num_hidden_layers), wanted)
    present = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    unused = set(present) - set(names) - set(_READ_ELSEWHERE)
    if "lm_head.weight" not in wanted:  # a pooling model drops its head
        unused.discard("output.weight")
    if unused:
        listed = sorted(unused)
        shown = ", ".join(listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
        raise ValueError(
            f"this GGUF has tensors the {arch} model has no place for: {shown} (a variant of "
            "the architecture that is not supported)"
        )
    for name, kind in present.items():
        if name in names and not _dequantizable(kind):
            raise ValueError(
                f"GGUF tensor {name} is of type {kind.name}, which cannot be dequantized"
            )
    return {name: keys for name, keys in names.items() if name in present}


def _dequantizable(kind: GGMLQuantizationType) -> bool:
    # gguf-py's dequantize handles F32 and F16 itself and the rest through its type table.
    return kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or (
        kind in getattr(quants, "_type_traits", {})
    )


def iter_gguf(
    reader: GGUFReader, hf_config: Any, wanted: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, float32 CPU tensor) for each key in `wanted` a GGUF tensor fills, a stacked
    expert tensor's one expert at a time."""
    arch = gguf_architecture(reader)
    names = gguf_names(reader, hf_config, wanted)
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    for tensor in reader.tensors:
        keys = names.get(tensor.name)
        if keys is None:
            continue
        if _is_expert_key(keys[0]):
            yield from _experts(tensor, keys)
            continue
        weight = _to_torch(dequantize(tensor.data, tensor.tensor_type))
        if arch in _PERMUTED_QK_ARCHS and ".attn_q." in tensor.name:
            weight = unpermute_qk(weight, num_heads)
        elif arch in _PERMUTED_QK_ARCHS and ".attn_k." in tensor.name:
            weight = unpermute_qk(weight, num_kv_heads)
        elif any(part in tensor.name for part in _VECTOR_IN_GGUF):
            weight = weight.reshape(1, -1)
        yield keys[0], weight


def _experts(tensor: Any, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The experts of a stacked tensor, one at a time: dequantized all at once, the stack
    would take its float32 size twice over (about 6 GiB for one projection of a Qwen3-235B
    layer)."""
    data = tensor.data  # [experts, out, in] floats, or [experts, out, bytes] of blocks
    if data.ndim != 3 or data.shape[0] != len(keys):
        raise ValueError(
            f"GGUF tensor {tensor.name} has shape {tuple(int(n) for n in reversed(tensor.shape))}"
            f": expected the model's {len(keys)} experts stacked along its first dimension"
        )
    for key, expert in zip(keys, data, strict=True):
        yield key, _to_torch(dequantize(expert, tensor.tensor_type))


def _is_expert_key(hf_name: str) -> bool:
    return _EXPERT_MODULE.fullmatch(hf_name.rpartition(".")[0]) is not None


def _to_torch(array: np.ndarray) -> torch.Tensor:
    # Unquantized tensors come back as read-only views of the memory-mapped file.
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)
