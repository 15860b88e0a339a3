"""Suite-wide rules: tests marked `gpu` skip cleanly where CUDA is absent; converted models are
cached in a folder of this test session, never in the user's cache, and the folder is removed when
the session ends (a converted SmolLM2 is about 500 MB, so a folder left per run fills the disk)."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

import pytest

# Set before any test runs, so subprocesses (`aioinfer serve` in tests) inherit it too. A cache
# named by the caller is theirs to keep.
if "AIOINFER_CACHE" not in os.environ:
    _session_cache = tempfile.mkdtemp(prefix="aioinfer-test-cache-")
    os.environ["AIOINFER_CACHE"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Without CUDA the Triton kernels run in Triton's interpreter. It must be chosen before the first
# kernel module is imported, by whichever test module comes first.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    # What the collection imported lives to the end of the session: keep it out of every later
    # garbage collection. An engine that shuts down collects (it frees the model's reference
    # cycles), and over the whole heap that took 0.5-1 s each, a third of the suite's time.
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()  # so that extension types freed at exit are not reported as leaked


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
