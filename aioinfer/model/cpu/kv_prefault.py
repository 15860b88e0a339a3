"""The CPU KV cache's pages, faulted in ahead of the block pool while the engine is idle.

The CPU cache is a lazily zero-filled mapping (kv_cache.lazy_zeros): 4 GiB cost nothing at
start, but the first write to each 4 KiB page faults, and until the pool has handed out every
block once (it hands them out from block 1 up), steps store their K/V into fresh pages. On the
2-vCPU VM of docs/benchmarks-log.md those faults took 1.9 ms of a 30 ms decode step of 16 SmolLM2
sequences. This thread faults in the pages of the blocks just past the highest block a step has
used (madvise MADV_POPULATE_WRITE, about 2 us a page where a store's fault took 3-5), keeping
the resident cache within `lookahead` blocks of what requests have used. It works only while
no step runs and none has ended for IDLE_SECONDS, and at SCHED_IDLE: it never competes with a
step for a core, and never holds the interpreter lock while steps run (a thread at idle priority
holding it while busy threads fill both cores would stall the event loop). A prefill step can
take half a second: a rule on steps' starts alone let the thread fault into such steps wherever
a core idled in them (with OpenMP's workers sleeping early, 3.2-3.7 s of CPU in a serving
benchmark run).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; older kernels answer EINVAL
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Bytes faulted in between two looks at the clock (about 1 ms, all layers together).
CHUNK_BYTES = 2 << 20
# The engine counts as idle once no step has run for this long.
IDLE_SECONDS = 0.05


def _madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


class KVPagePrefaulter:
    """Faults in the pages of blocks [1, highest block used + lookahead blocks) of every
    layer's cache ([num_blocks, ...] contiguous CPU tensors), in block order."""

    def __init__(self, caches: Sequence[torch.Tensor], lookahead_blocks: int) -> None:
        self.caches = list(caches)
        self.num_blocks = self.caches[0].shape[0] if self.caches else 0
        self.block_bytes = self.caches[0][0].nbytes if self.caches else 0
        self.lookahead_blocks = lookahead_blocks
        self.faulted_blocks = 1  # blocks [0, faulted_blocks) are done (block 0: padding only)
        self._target = min(self.num_blocks, 1 + lookahead_blocks)
        self._last_step = 0.0  # when the last step ended
        self._stepping = False
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        madvise = _madvise() if sys.platform == "linux" else None  # advice 23 is Linux's
        if madvise is None or self.block_bytes == 0:
            return
        self._thread = threading.Thread(
            target=self._run, args=(madvise,), name="aioinfer-kv-prefault", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def step(self, highest_block: int) -> Iterator[None]:
        """A step runs, using blocks up to `highest_block`: keep `lookahead` blocks past it
        faulted in, once the engine is idle again."""
        self._stepping = True
        target = min(self.num_blocks, highest_block + 1 + self.lookahead_blocks)
        if target > self._target:
            with self._wake:
                self._target = target
                self._wake.notify()
        try:
            yield
        finally:
            self._last_step = time.monotonic()
            self._stepping = False

    def stop(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _busy_for(self) -> float:
        """Seconds until the engine counts as idle (<= 0: it is)."""
        if self._stepping:
            return IDLE_SECONDS
        return self._last_step + IDLE_SECONDS - time.monotonic()

    def _run(self, madvise: Any) -> None:
        try:  # this thread only: Linux schedules threads one by one
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            os.nice(19)
        per_chunk = max(1, CHUNK_BYTES // (self.block_bytes * len(self.caches)))
        while True:
            with self._wake:
                while not self._stopped:
                    if self.faulted_blocks >= self._target:
                        self._wake.wait()
                        continue
                    busy_for = self._busy_for()
                    if busy_for <= 0:
                        break
                    self._wake.wait(busy_for)
                if self._stopped:
                    return
                end = min(self._target, self.faulted_blocks + per_chunk)
            for cache in self.caches:
                if self._busy_for() > 0:
                    break  # a step started: wait for the next idle spell, then redo the chunk
                start = cache.data_ptr() + self.faulted_blocks * self.block_bytes
                stop = cache.data_ptr() + end * self.block_bytes
                first = start - start % PAGE  # madvise takes whole pages
                if madvise(first, stop - first, MADV_POPULATE_WRITE) != 0:
                    error = ctypes.get_errno()
                    logger.debug("KV page prefaulting stopped: %s", os.strerror(error))
                    return
            else:
                self.faulted_blocks = end
