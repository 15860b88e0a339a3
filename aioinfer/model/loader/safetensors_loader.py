"""Stream the tensors of a safetensors checkpoint (one file or shards with an index)."""

from __future__ import annotations

import json
from collections.abc import Container, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_SUFFIX = ".safetensors.index.json"


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
    """(name, CPU tensor) for each key in `wanted`, one at a time; other keys are never read."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in wanted:
                    yield name, f.get_tensor(name)
