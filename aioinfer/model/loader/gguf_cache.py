"""A converted-model cache for GGUF checkpoints: parse and dequantize a .gguf once, reuse it.

Every start that reads a .gguf pays for `gguf.GGUFReader` (it walks each metadata field in
Python), for dequantizing each tensor and for rebuilding the tokenizer through transformers. The
first start with a given file writes what these produce into a Hugging Face-style folder,

    ${AIOINFER_CACHE:-~/.cache/aioinfer}/gguf/<key>/
        model.safetensors       dequantized float32 weights under HF keys (shards + index if big)
        config.json             the HF config rebuilt from the GGUF metadata
        tokenizer.json          the tokenizer transformers rebuilds from the GGUF, and
        tokenizer_config.json   its special tokens and chat template (both absent when the GGUF
                                holds no vocabulary)
        manifest.json           the source's fingerprint and each file's size (and hash)

and later starts resolve the .gguf to that folder (kind "folder", the served name still the
GGUF's) without opening the GGUF at all; the weights are then memory-mapped.

The key hashes the file's size, mtime, first MiB (magic, version, counts and the start of the
metadata) and last MiB with the cache format version, so a file rewritten in place, even with
its mtime kept, gets a new entry unless the change is in neither end (checking more would cost
a read of the whole file at every start). An entry is written
into a temporary folder and renamed into place, so no reader sees half of one. An entry that
fails its check (unreadable manifest or one of another file, a listed file missing or of another
size or hash, a safetensors file whose header does not end where the file ends) is rebuilt, never
loaded. Tensor data is checked by size and layout, not hashed: hashing it at every start would
cost about what the cache saves. Entries are never evicted; AIOINFER_GGUF_CACHE=0 turns the cache
off, and a cache folder that cannot be written (or a disk without room for the float32
weights) makes the GGUF load directly. A GGUF whose tokenizer cannot be rebuilt still gets an
entry, without one: the tokenizer is then built from the GGUF itself when it is needed (so it
fails there, as without the cache, unless another tokenizer is given).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError

from aioinfer.model.loader.gguf_config import (
    gguf_generation_config,
    gguf_hf_config,
    gguf_served_name,
    open_gguf,
    resolve_gguf,
)
from aioinfer.model.loader.resolved import (
    ResolvedModel,
    read_json,
    read_saved_config,
)

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

CACHE_ENV = "AIOINFER_CACHE"
DEFAULT_CACHE = "~/.cache/aioinfer"
# Bump when the layout or the conversion changes: old entries are then never looked up.
CACHE_FORMAT = 2
HEADER_BYTES = 1 << 20
GiB = 1 << 30
# Room left on the disk beyond the entry (the manifest, the tokenizer, other writers).
DISK_MARGIN = 1 << 30
MANIFEST = "manifest.json"
REQUIRED_FILES = ("config.json",)
# save_file holds a shard and its serialized bytes at once: this bounds conversion memory.
SHARD_BYTES = 1 << 30
# Leftovers of a conversion that was killed; younger ones may belong to a running one.
STALE_SECONDS = 24 * 3600
_TEMP_PREFIX = ".tmp-"
_LOCK_FILE = ".converting"
_OLD_PREFIX = ".old-"


def cache_root() -> Path:
    """The aioinfer cache folder: $AIOINFER_CACHE, else ~/.cache/aioinfer."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


@dataclass(frozen=True)
class GGUFFingerprint:
    """What identifies a .gguf file's content without reading all of it."""

    size: int
    mtime_ns: int
    header_sha256: str
    """sha256 of the first HEADER_BYTES bytes."""
    tail_sha256: str
    """sha256 of the last HEADER_BYTES bytes (the last tensors' data)."""

    @classmethod
    def of(cls, path: Path) -> GGUFFingerprint:
        stat = path.stat()
        with path.open("rb") as f:
            header = f.read(HEADER_BYTES)
            f.seek(max(stat.st_size - HEADER_BYTES, 0))
            tail = f.read(HEADER_BYTES)
        return cls(
            stat.st_size,
            stat.st_mtime_ns,
            hashlib.sha256(header).hexdigest(),
            hashlib.sha256(tail).hexdigest(),
        )

    @property
    def key(self) -> str:
        text = f"{CACHE_FORMAT}:{self.size}:{self.mtime_ns}:{self.header_sha256}:{self.tail_sha256}"
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def entry_dir(path: Path, root: Path | None = None) -> Path:
    """The cache folder for the .gguf at `path` (which need not exist yet)."""
    return (root or cache_root()) / "gguf" / GGUFFingerprint.of(path).key


def resolve_gguf_cached(path: Path, dummy: bool = False) -> ResolvedModel:
    """`path` resolved to its cache entry, converting it first when there is no usable one.

    With `dummy` (random weights) a missing entry is not built: the GGUF is read directly. Where
    the cache cannot be written, the GGUF is loaded directly with a warning.
    """
    path = path.resolve()
    fingerprint = GGUFFingerprint.of(path)
    folder = cache_root() / "gguf" / fingerprint.key
    if folder.parent.is_dir():  # before the free-space check: a dead conversion's folder
        _remove_stale(folder.parent)
    problem = check_entry(folder, fingerprint)
    if problem is None:
        logger.info("GGUF cache hit: %s -> %s", path.name, folder)
        return _resolved_from_entry(path, folder, dummy)
    if folder.exists():
        logger.warning("GGUF cache entry %s is unusable (%s); rebuilding it", folder, problem)
    if dummy:
        return resolve_gguf(path, dummy=True)
    reader = open_gguf(path)
    needed, free = _float32_bytes(reader), _free_bytes(folder.parent)
    if free is not None and free < needed + DISK_MARGIN:
        logger.warning(
            "no room for the GGUF cache (%.1f GiB of float32 weights, %.1f GiB free under %s); "
            "loading %s directly",
            needed / GiB,
            free / GiB,
            folder.parent,
            path,
        )
        return resolve_gguf(path, reader=reader)
    try:
        convert_gguf(path, folder, fingerprint, reader)
    except (OSError, SafetensorError) as exc:  # save_file's I/O errors are SafetensorErrors
        logger.warning("cannot write the GGUF cache (%s); loading %s directly", exc, path)
        return resolve_gguf(path, reader=reader)
    return _resolved_from_entry(path, folder, dummy=False)


def _float32_bytes(reader: GGUFReader) -> int:
    """What the entry's weights take: every tensor dequantized to float32."""
    return sum(4 * int(tensor.n_elements) for tensor in reader.tensors)


def _free_bytes(folder: Path) -> int | None:
    """Free bytes on the disk that holds (or will hold) `folder`; None when unknown."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _resolved_from_entry(path: Path, folder: Path, dummy: bool) -> ResolvedModel:
    return ResolvedModel(
        kind="dummy" if dummy else "folder",
        folder=folder,
        hf_config=read_saved_config(folder),
        served_name=gguf_served_name(path),
        generation_config=read_json(folder / "generation_config.json"),
        converted_from=path,
    )


# ----------------------------------------------------------------------------- checking


def check_entry(folder: Path, fingerprint: GGUFFingerprint) -> str | None:
    """Why the entry in `folder` must not be loaded, or None when it is whole."""
    if not folder.is_dir():
        return "no entry"
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        return "manifest of another format"
    if any(manifest.get(k) != v for k, v in fingerprint.as_dict().items()):
        return "manifest of another file"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "manifest lists no files"
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing or not any(name.endswith(".safetensors") for name in files):
        return f"manifest lacks {missing or 'weights'}"
    for name, meta in files.items():
        problem = _check_file(folder, name, meta)
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _check_file(folder: Path, name: Any, meta: Any) -> str | None:
    from aioinfer.model.loader.safetensors_loader import check_safetensors_file

    if not isinstance(name, str) or Path(name).name != name or not isinstance(meta, dict):
        return "bad manifest entry"
    path = folder / name
    if not path.is_file():
        return "missing"
    if path.stat().st_size != meta.get("size"):
        return "size differs from the manifest"
    if name.endswith(".safetensors"):
        try:
            check_safetensors_file(path)
        except ValueError as exc:
            return str(exc)
    elif _sha256(path) != meta.get("sha256"):
        return "content differs from the manifest"
    return None


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------------------- converting


def convert_gguf(
    path: Path,
    folder: Path,
    fingerprint: GGUFFingerprint,
    reader: GGUFReader | None = None,
    progress: bool = True,
) -> None:
    """Write the cache entry for `path` into `folder`, atomically (temp folder + rename).

    `reader` is the file's open reader, if the caller has one. Raises OSError when the cache
    folder cannot be written; nothing half-written is left under `folder`.
    """
    start = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder.parent)
    logger.info(
        "converting %s into %s (once: later starts read the converted folder)", path.name, folder
    )
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{folder.name}-", dir=folder.parent))
    lock = None
    try:
        lock = _lock_in(tmp)
        if reader is None:
            reader = open_gguf(path)
        _write_entry(path, reader, tmp, progress)
        if lock is not None:  # not part of the entry; the lock stays held until close
            (tmp / _LOCK_FILE).unlink()
        _write_manifest(tmp, path, fingerprint)
        _apply_umask(tmp)
        _publish(tmp, folder, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)


def _write_entry(path: Path, reader: GGUFReader, folder: Path, progress: bool) -> None:
    from aioinfer.model.loader.gguf_loader import gguf_names, iter_gguf
    from aioinfer.model.loader.weight_names import checkpoint_keys

    hf_config = gguf_hf_config(reader)
    wanted = checkpoint_keys(hf_config)
    num_tensors = sum(map(len, gguf_names(reader, hf_config, wanted).values()))
    with _progress_bar(f"Converting {path.name}", num_tensors + 1, progress) as advance:
        _write_weights(iter_gguf(reader, hf_config, wanted), folder, advance)
        hf_config.save_pretrained(folder)
        sampling = gguf_generation_config(reader)
        if sampling is not None:  # read back as the model's generation_config.json
            (folder / "generation_config.json").write_text(json.dumps(sampling), encoding="utf-8")
        if "tokenizer.ggml.tokens" not in reader.fields:
            logger.warning("%s holds no vocabulary: the cache entry has no tokenizer", path.name)
        else:
            try:
                _write_tokenizer(path, folder)
            except ValueError as exc:  # a tokenizer kind transformers cannot rebuild
                logger.warning("the cache entry of %s has no tokenizer: %s", path.name, exc)
        advance()


def _write_weights(
    tensors: Iterator[tuple[str, Any]], folder: Path, advance: Callable[[], None]
) -> None:
    """Safetensors shards of at most SHARD_BYTES; one file is named model.safetensors."""
    from safetensors.torch import save_file

    shards: list[str] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_bytes = 0

    def flush() -> None:
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        shards.append(name)
        weight_map.update(dict.fromkeys(shard, name))

    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
            shard, shard_bytes = {}, 0
        shard[key] = tensor.contiguous()
        shard_bytes += nbytes
        advance()
    flush()
    if len(shards) == 1:
        os.rename(folder / shards[0], folder / "model.safetensors")
        return
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(path: Path, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json (chat template inside) as transformers rebuilds
    them from the GGUF metadata."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)


def _entry_files(folder: Path) -> list[Path]:
    """The entry's files: not the hidden ones a filesystem may keep there (NFS keeps a deleted
    file that is still open as .nfsXXXX until it is closed)."""
    return sorted(file for file in folder.iterdir() if not file.name.startswith("."))


def _write_manifest(folder: Path, path: Path, fingerprint: GGUFFingerprint) -> None:
    files = {}
    for file in _entry_files(folder):
        meta: dict[str, Any] = {"size": file.stat().st_size}
        if not file.name.endswith(".safetensors"):
            meta["sha256"] = _sha256(file)
        files[file.name] = meta
    manifest = {
        "format": CACHE_FORMAT,
        "source": str(path),
        **fingerprint.as_dict(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def _publish(tmp: Path, folder: Path, fingerprint: GGUFFingerprint) -> None:
    """Rename `tmp` to `folder`; a broken entry there is moved aside first. Another process that
    published a whole entry in the meantime wins, and `tmp` is left for the caller to remove."""
    old: Path | None = None
    if folder.exists():
        if check_entry(folder, fingerprint) is None:
            return
        old = folder.with_name(f"{_OLD_PREFIX}{folder.name}-{tmp.name}")
        try:
            os.rename(folder, old)
        except FileNotFoundError:
            old = None
    try:
        os.rename(tmp, folder)
    except OSError:
        if check_entry(folder, fingerprint) is not None:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _apply_umask(folder: Path) -> None:
    """The modes a plain mkdir/open would give: mkdtemp makes the folder private, and a cache
    shared between users (AIOINFER_CACHE) must stay readable."""
    umask = current_umask()
    os.chmod(folder, 0o777 & ~umask)
    for file in _entry_files(folder):
        os.chmod(file, 0o666 & ~umask)


def current_umask() -> int:
    # Read, not set: os.umask() changes it for every thread while it is being read.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _lock_in(tmp: Path) -> int | None:
    """A conversion holds an exclusive lock on a file in its temp folder for as long as its
    process lives (the kernel drops it when the process ends, however it ends). The file is
    locked under another name first, so that no sweep ever finds it unlocked. None where the
    filesystem has no locks: the folder is then left to the age rule."""
    locking = tmp / f"{_LOCK_FILE}-new"
    fd = os.open(locking, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # e.g. ENOLCK on an NFS mount without its lock daemon
        os.close(fd)
        locking.unlink()
        return None
    os.rename(locking, tmp / _LOCK_FILE)
    return fd


def _owner_is_gone(tmp: Path) -> bool:
    """Whether the process converting into `tmp` has ended (a signal cut its conversion short:
    the server leaves at once, before the folder's cleanup): nobody holds its lock."""
    try:
        fd = os.open(tmp / _LOCK_FILE, os.O_RDWR)
    except OSError:  # no lock file yet (or any more): leave it to the age rule
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: the conversion runs (or the filesystem cannot tell)
        return False
    finally:
        os.close(fd)
    return True


def _remove_stale(parent: Path) -> None:
    """Remove what conversions left: temp folders of ended processes at once, any other temp
    or replaced folder after STALE_SECONDS."""
    now = time.time()
    for child in parent.iterdir():
        if not child.name.startswith((_TEMP_PREFIX, _OLD_PREFIX)):
            continue
        try:
            dead = child.name.startswith(_TEMP_PREFIX) and _owner_is_gone(child)
            if dead or now - child.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(child, ignore_errors=True)
        except OSError:
            continue


@contextmanager
def _progress_bar(title: str, total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr; yields the function that advances it by one."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(title, total=total)
        yield lambda: bar.advance(task)
