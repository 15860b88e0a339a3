"""Stream the tensors of a safetensors checkpoint (one file or shards with an index).

`safe_open` memory-maps each file and `get_tensor` returns a CPU tensor over that map (private,
copy-on-write), so a tensor whose dtype and device already match the model's becomes the
parameter itself: no read into a buffer, no copy, and the page cache is shared between processes
that serve the same file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Container, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_SUFFIX = ".safetensors.index.json"
_HEADER_LENGTH = struct.Struct("<Q")
# A header longer than this is corrupt (safetensors itself caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def safetensors_files(folder: Path) -> list[Path]:
    """The shards an index names, or every *.safetensors file when there is no index."""
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if indexes:
        with indexes[0].open(encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"{indexes[0]} names shards that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} holds no *.safetensors weights")
    return files


def iter_safetensors(folder: Path, wanted: Container[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for each key in `wanted`, one at a time; other keys are never read.
    A bare decoder's keys (`layers.0...` of a Qwen3Model checkpoint) fill `model.layers.0...`."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = name if name in wanted else f"model.{name}"
                if target in wanted:
                    yield target, _unscaled(f.get_tensor(name), name, path)


def _unscaled(tensor: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    """`tensor`, unless it is a float8 (or packed float4) one: those mean nothing without the
    scale tensors of a quantized checkpoint, and converting them to the model's dtype would
    silently give garbage."""
    # The floats of one byte: float8 e4m3fn, e5m2, their fnuz kinds, e8m0, float4_e2m1fn_x2.
    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
        raise ValueError(
            f"weight {name} in {path} is {str(tensor.dtype).removeprefix('torch.')}: an fp8 or fp4 "
            "checkpoint needs its scales, which aioinfer does not apply; serve an unquantized "
            "checkpoint (float16, bfloat16 or float32 safetensors) or a GGUF file instead"
        )
    return tensor


def check_safetensors_file(path: Path) -> None:
    """Raise ValueError unless `path` is a whole safetensors file: a readable JSON header whose
    tensors end exactly at the end of the file (so a truncated file is caught without reading
    its data)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(_HEADER_LENGTH.size)
        if len(prefix) < _HEADER_LENGTH.size:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (header_len,) = _HEADER_LENGTH.unpack(prefix)
        if header_len > min(_MAX_HEADER_BYTES, size):
            raise ValueError(f"{path} has a corrupt header length {header_len}")
        try:
            header = json.loads(f.read(header_len))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"{path} has a corrupt header: {exc}") from exc
    expected = _HEADER_LENGTH.size + header_len + max(ends, default=0)
    if expected != size:
        raise ValueError(f"{path} holds {size} bytes but its header describes {expected}")
