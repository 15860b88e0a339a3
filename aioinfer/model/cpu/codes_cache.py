"""The byte codes of a GGUF cache entry's linears, found at one start and read at the next.

Finding them (`code_weight`) takes about 6 ns a weight on two quiet cores, and many times that
when other work holds the cores (its many short parallel regions each wait for a busy core): a
warm start of the bundled model spent 15-18 s there on a loaded 2-core machine. An entry's
weights never change (the entry is named by its GGUF file), so the codes are written beside
them once, `cpu-codes-<digest>.bin` (a safetensors file, named so that no loader takes it for
the entry's weights), and read back at later starts. The digest covers
what finds the codes (packed_weights.py and kernels.c), so a changed coder writes a new file.

The file is trusted as the entry's weights are: it lives in the same folder, written by the
same user. Reading it fails soft (a file that does not read, or a weight of another shape, is
found again), and so does writing it (a read-only cache just finds them at every start).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from aioinfer.model.cpu.packed_weights import CODE_BLOCK, STRIP, CodedWeight
from aioinfer.model.loader.gguf_cache import current_umask

logger = logging.getLogger(__name__)

_PREFIX = "cpu-codes-"
_CODER_SOURCES = ("packed_weights.py", "kernels.c")


def codes_file(entry: Path) -> Path:
    """Where the codes of the GGUF cache entry `entry` are kept."""
    digest = hashlib.sha256()
    for name in _CODER_SOURCES:
        digest.update(Path(__file__).with_name(name).read_bytes())
    return entry / f"{_PREFIX}{digest.hexdigest()[:16]}.bin"


def read_codes(path: Path) -> dict[str, CodedWeight | None]:
    """The codes kept in `path` by linear name (None: that weight has no codes); empty when
    there is no such file or it does not read."""
    if not path.is_file():
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            known: dict[str, CodedWeight | None] = dict.fromkeys(json.loads(meta["uncoded"]))
            for name in json.loads(meta["coded"]):
                codes, scales = f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales")
                known[name] = CodedWeight(codes, scales)
    except Exception as exc:  # a damaged file: the codes are found again, never fatal
        logger.warning("Ignoring the kept byte codes %s: %s", path, exc)
        return {}
    return known


def write_codes(path: Path, codes: Mapping[str, CodedWeight | None]) -> None:
    """Keep `codes` in `path` (atomically; earlier coders' files are removed)."""
    from safetensors.torch import save_file

    coded = {n: c for n, c in codes.items() if c is not None}
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in coded.items():
        tensors[f"{name}.codes"] = weight.codes.contiguous()
        tensors[f"{name}.scales"] = weight.scales.contiguous()
    meta = {
        "coded": json.dumps(sorted(coded)),
        "uncoded": json.dumps(sorted(n for n, c in codes.items() if c is None)),
    }
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".codes", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.chmod(tmp, 0o666 & ~current_umask())  # as the entry's own files
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in path.parent.glob(f"{_PREFIX}*"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError as exc:  # a cache this user may read but not write
        logger.debug("cannot keep the byte codes in %s: %s", path, exc)


def fits(coded: CodedWeight, weight: torch.Tensor) -> bool:
    """Whether kept codes have the shapes of `weight` [N, K]'s."""
    n, k = weight.shape
    return tuple(coded.codes.shape) == (n // STRIP, k, STRIP) and tuple(coded.scales.shape) == (
        n // STRIP,
        k // CODE_BLOCK,
        2,
        STRIP,
    )
