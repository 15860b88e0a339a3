"""The CPU KV cache's page prefaulter: it faults in the pages of the blocks just past the
highest one used, no further, keeps what steps wrote, runs at idle priority and stops."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import pytest
import torch

from aioinfer.gpu.kv_cache import lazy_zeros
from aioinfer.model.cpu.kv_prefault import IDLE_SECONDS, PAGE, KVPagePrefaulter

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and mincore: Linux")

SHAPE = (64, 2, 16, 3, 64)  # 64 blocks of 24 KiB (six pages) a layer, as SmolLM2's


def layers(n: int = 2) -> list[torch.Tensor]:
    return [lazy_zeros(SHAPE, torch.float32) for _ in range(n)]


def resident_blocks(cache: torch.Tensor) -> list[bool]:
    """Whether each block's pages are all in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = cache.nbytes // PAGE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(cache.data_ptr()), ctypes.c_size_t(cache.nbytes), vec) == 0
    per_block = cache[0].nbytes // PAGE
    return [all(vec[b * per_block + i] & 1 for i in range(per_block)) for b in range(SHAPE[0])]


def wait_for(prefaulter: KVPagePrefaulter, blocks: int) -> None:
    deadline = time.monotonic() + 10
    while prefaulter.faulted_blocks < blocks:
        assert time.monotonic() < deadline, f"faulted {prefaulter.faulted_blocks} of {blocks}"
        time.sleep(0.005)


def test_pages_are_faulted_a_lookahead_past_the_highest_block_used_and_no_further():
    caches = layers()
    prefaulter = KVPagePrefaulter(caches, lookahead_blocks=8)
    prefaulter.start()
    try:
        wait_for(prefaulter, 9)  # blocks 1-8 before any step
        time.sleep(0.05)
        for cache in caches:
            resident = resident_blocks(cache)
            assert all(resident[1:9]) and not any(resident[9:])
        with prefaulter.step(20):  # a step uses blocks up to 20
            pass
        wait_for(prefaulter, 29)
        time.sleep(0.05)
        assert prefaulter.faulted_blocks == 29
        for cache in caches:
            resident = resident_blocks(cache)
            assert all(resident[1:29]) and not any(resident[29:])
        with prefaulter.step(200):  # past the end: up to the last block
            pass
        wait_for(prefaulter, 64)
        assert all(resident_blocks(caches[1])[1:])
    finally:
        prefaulter.stop()


def test_what_steps_wrote_before_the_prefault_stays():
    caches = layers(1)
    written = torch.randn(SHAPE[1:])
    caches[0][5] = written  # a step stored into block 5 before the thread got there
    prefaulter = KVPagePrefaulter(caches, lookahead_blocks=16)
    prefaulter.start()
    try:
        wait_for(prefaulter, 17)
    finally:
        prefaulter.stop()
    assert torch.equal(caches[0][5], written)
    assert not caches[0][6].any()  # fresh pages read as zeros


def test_the_thread_runs_at_idle_priority_and_stops():
    prefaulter = KVPagePrefaulter(layers(1), lookahead_blocks=4)
    prefaulter.start()
    wait_for(prefaulter, 5)
    thread = prefaulter._thread  # other engines of the process may have theirs
    assert thread is not None and thread.name == "aioinfer-kv-prefault"
    assert thread.native_id is not None
    assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE
    assert prefaulter.running  # waiting for a step to move the highest block
    prefaulter.stop()
    assert not prefaulter.running and not thread.is_alive()


def test_nothing_is_faulted_while_steps_keep_starting():
    prefaulter = KVPagePrefaulter(layers(), lookahead_blocks=8)
    prefaulter.start()
    try:
        wait_for(prefaulter, 9)
        busy_until = time.monotonic() + 0.4
        while time.monotonic() < busy_until:  # a step every 10 ms
            with prefaulter.step(20):
                time.sleep(0.002)
            time.sleep(0.008)
            assert prefaulter.faulted_blocks == 9
        wait_for(prefaulter, 29)  # then the engine idles
    finally:
        prefaulter.stop()


def test_nothing_is_faulted_during_a_step_longer_than_the_idle_spell():
    prefaulter = KVPagePrefaulter(layers(), lookahead_blocks=8)
    prefaulter.start()
    try:
        wait_for(prefaulter, 9)
        with prefaulter.step(20):  # a long prefill step
            time.sleep(8 * IDLE_SECONDS)
            assert prefaulter.faulted_blocks == 9
        wait_for(prefaulter, 29)  # it ended: the engine idles
    finally:
        prefaulter.stop()
