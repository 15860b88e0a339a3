"""torch.cuda's memory counters for a simulated device, so that CPU tests take the CUDA branch
of the memory profile (gpu/kv_cache.py) with the real profiling pass running on the CPU."""

from __future__ import annotations

import pytest
import torch

from aioinfer.gpu import kv_cache

GiB = 1 << 30
# The CUDA context, created before the engine's first reading: outside its share.
CONTEXT = GiB // 2


class FakeDevice:
    """A device where others hold `others` bytes; the engine's process holds its context, then
    its weights (torch) and `extra` bytes of cuBLAS and kernel modules; its profiling pass peaks
    `activations` bytes above the weights and its own KV cache."""

    def __init__(self, total: int, others: int, weights: int, extra: int, activations: int):
        self.total, self.weights, self.extra, self.activations = total, weights, extra, activations
        self.free = total - others - CONTEXT
        self.cache_bytes = 0  # of the last KV cache allocated

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
            monkeypatch.setattr(cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.weights)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.weights)
        peak = lambda device=None: self.weights + self.cache_bytes + self.activations  # noqa: E731
        monkeypatch.setattr(cuda, "max_memory_allocated", peak)
        allocate = kv_cache.KVCacheLayout.allocate

        def allocate_and_count(layout: kv_cache.KVCacheLayout, num_blocks: int):
            caches = allocate(layout, num_blocks)
            self.cache_bytes = sum(c.numel() * c.element_size() for c in caches)
            return caches

        monkeypatch.setattr(kv_cache.KVCacheLayout, "allocate", allocate_and_count)

    def load_weights(self) -> None:
        self.free -= self.weights + self.extra
