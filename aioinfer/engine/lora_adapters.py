"""The LoRA adapters an engine has loaded: their names, their slots in the runner (which
model/lora.py applies) and their folders. Loading and unloading run on the GPU thread,
between steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aioinfer.core.lora import LoRARequest


class LoRAAdapters:
    def __init__(self, gpu: Any) -> None:
        self._gpu = gpu
        self.slots: dict[str, int] = {}  # loaded adapters by name
        self.paths: dict[str, str] = {}  # their folders (also those still loading)

    async def add(self, lora: LoRARequest) -> None:
        """Load an adapter so that requests may name it; a no-op when it is loaded already.
        ValueError for an adapter the model cannot take, a name loaded (or being loaded) from
        another path, or without --enable-lora."""
        name, path = lora.lora_name, lora.lora_path
        known = self.paths.get(name)
        if known is not None and name in self.slots and known == path:
            return
        if known is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded from {known}")
        self.paths[name] = path  # reserved while it loads
        try:
            runner_call = self._gpu.call(lambda: self._gpu.runner.load_lora(lora))
            slot = await asyncio.wrap_future(runner_call)
        except BaseException:
            del self.paths[name]
            raise
        self.slots[name] = slot

    async def remove(self, name: str, users_of: Callable[[int], int]) -> None:
        """Unload an adapter; KeyError when none has that name, ValueError while `users_of`
        its slot (unfinished requests) is not 0."""
        slot = self.slots.pop(name)  # from now on no new request can name it
        users = users_of(slot)
        if users:
            self.slots[name] = slot
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        del self.paths[name]
        await asyncio.wrap_future(self._gpu.call(lambda: self._gpu.runner.unload_lora(name)))

    def slot_of(self, name: str | None) -> int:
        """The slot a request naming `name` runs with (0: no adapter)."""
        if name is None:
            return 0
        slot = self.slots.get(name)
        if slot is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return slot


async def load_for_batch(engine: Any, adapters: dict[str, LoRARequest]) -> None:
    """Load an offline batch's adapters into `engine` (an AsyncEngine); when the slots are
    full, unload adapters this batch does not use (the offline API is given every adapter's
    path, so they load again when next needed). A name given with another path than before is
    loaded from the new one."""
    limit = engine.model_config.max_loras
    if len(adapters) > limit:
        raise ValueError(f"these prompts use {len(adapters)} LoRA adapters; max_loras is {limit}")
    for name, adapter in adapters.items():
        if engine.loras.paths.get(name) == adapter.lora_path:
            continue
        if name in engine.loras.paths:
            await engine.remove_lora(name)
        idle = [loaded for loaded in engine.loras.slots if loaded not in adapters]
        if len(engine.loras.slots) >= limit and idle:
            await engine.remove_lora(idle[0])  # the longest loaded
        await engine.add_lora(adapter)
