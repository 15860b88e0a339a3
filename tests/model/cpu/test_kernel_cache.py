"""The compiled kernels' cache: loading a library runs its code, and the cached library's name
is predictable, so a library someone else could have written is never loaded. Its folder is
made 0700; a cached library is loaded only when the file (opened without following links) and
the folders above it are this user's and no one else may write them; otherwise the kernels
are built privately for the process. A library that does not load falls back to torch.

Builds here copy the suite's one real build (a compile takes 10-20 s), so each case checks
which build ran without compiling again."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aioinfer.model.cpu import kernels as cpu_native

PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int packed_linear(void) { return 0; }
"""


@pytest.fixture
def real_build() -> Path:
    built = cpu_native.load()
    if built is None:
        pytest.skip(cpu_native.unavailable_reason())
    return Path(built.path)


@pytest.fixture
def cache(tmp_path, monkeypatch, real_build) -> Iterator[dict]:
    """A fresh AIOINFER_CACHE whose builds are copies of the real one, recorded."""
    monkeypatch.setenv("AIOINFER_CACHE", str(tmp_path / "cache"))
    builds: list[Path] = []
    copy = real_build.read_bytes()

    def build(cc: str, cflags: list[str], target: Path) -> None:
        builds.append(target)
        tmp = target.with_name(".tmp-build")
        tmp.write_bytes(copy)
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)

    monkeypatch.setattr(cpu_native, "_build", build)
    cpu_native._load.cache_clear()
    yield {"builds": builds, "target": cpu_native.cached_library(), "tmp": tmp_path}
    cpu_native._load.cache_clear()  # later tests load the suite's own build again


def plant(tmp_path: Path, target: Path, *, with_constructor: bool = True) -> Path:
    """A library at `target` whose constructor writes a marker file when it is loaded."""
    marker = tmp_path / "marker"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED if with_constructor else "int unrelated(void) { return 1; }\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    os.chmod(target, 0o755)
    return marker


def loaded_privately(cache: dict) -> bool:
    """The kernels loaded, from a build of this process's own (outside the cache)."""
    kernels = cpu_native.load()
    assert kernels is not None, cpu_native.unavailable_reason()
    [built] = cache["builds"]
    return built.parent != cache["target"].parent and Path(kernels.path) == built


def test_a_fresh_cache_builds_into_a_private_folder_and_is_reused(cache):
    kernels = cpu_native.load()
    target = cache["target"]
    assert kernels is not None and Path(kernels.path) == target.parent.resolve() / target.name
    assert cache["builds"] == [target.parent.resolve() / target.name]
    assert os.stat(target.parent).st_mode & 0o777 == 0o700
    assert os.stat(target).st_mode & 0o077 == 0
    cpu_native._load.cache_clear()
    assert cpu_native.load() is not None and len(cache["builds"]) == 1  # loaded, not built


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "another user's"])
def test_a_planted_library_is_not_loaded_and_a_fresh_build_is(cache, how, caplog):
    target = cache["target"]
    target.parent.mkdir(parents=True, mode=0o700)
    marker = plant(cache["tmp"], target)
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("making a file another user's needs root")
        os.chown(target, 65534, 65534)
    else:
        os.chmod(target, 0o777 if how == "world-writable" else 0o775)
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert loaded_privately(cache)
    assert not marker.exists()
    assert "building them for this process alone" in caplog.text
    assert target.exists() and not any(cache["tmp"].glob("aioinfer-kernels-*"))


@pytest.mark.parametrize("how", ["world-writable folder", "link", "foreign cache root"])
def test_a_library_in_a_folder_others_may_write_or_behind_a_link_is_not_loaded(cache, how):
    target = cache["target"]
    if how == "link":
        marker = plant(cache["tmp"], cache["tmp"] / "elsewhere" / target.name)
        target.parent.mkdir(parents=True, mode=0o700)
        target.symlink_to(cache["tmp"] / "elsewhere" / target.name)
    else:
        target.parent.mkdir(parents=True, mode=0o700)
        marker = plant(cache["tmp"], target)
        if how == "world-writable folder":
            os.chmod(target.parent, 0o777)
        else:
            if os.geteuid() != 0:
                pytest.skip("making a folder another user's needs root")
            os.chown(target.parent.parent, 65534, 65534)  # the cache root above kernels/
    assert loaded_privately(cache)
    assert not marker.exists()


def test_a_cache_this_user_cannot_write_builds_privately(cache):
    target = cache["target"]
    shutil.rmtree(target.parent.parent, ignore_errors=True)
    target.parent.parent.write_text("not a folder")  # mkdir of kernels/ fails
    assert loaded_privately(cache)


def test_a_library_that_lacks_a_kernel_falls_back_to_torch_with_a_warning(cache, caplog):
    """A cached library of this user's that is not a build of the kernels (a missing symbol
    raised AttributeError, which failed the start instead of falling back)."""
    target = cache["target"]
    target.parent.mkdir(parents=True, mode=0o700)
    plant(cache["tmp"], target, with_constructor=False)
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.load() is None
    assert "packed_linear" in cpu_native.unavailable_reason()
    assert "using torch ops" in caplog.text and cache["builds"] == []

    # The real build loads next in this process, though the refused library stays loaded
    # under the name of the file number it was opened as (dlopen knows libraries by name).
    target.unlink()
    cpu_native._load.cache_clear()
    kernels = cpu_native.load()
    assert kernels is not None, cpu_native.unavailable_reason()
    assert cache["builds"] == [target.parent.resolve() / target.name]
