"""How many compute threads the model runs on: no more than the cores other work leaves free.

A step on the CPU, and a start (weights copied, packed and converted, a warm-up step), are
mostly short parallel regions. When another process keeps a core busy, each region of a
two-thread team waits at its barrier for the thread the scheduler has put off its core:

- A warm start of the bundled model on two cores, one of them busy, reached a healthy /health
  in 6.9 s with two threads and 5.2 s with one; on quiet cores, 4.5 s with two and 5.5 s
  with one.
- Serving SmolLM2 to 16 clients beside a busy core gave 68-71 output tok/s with two threads
  and 111-113 with one.

So the start measures how busy the cores are with others' work (the machine's busy time minus
this process's own) while the model resolves, and builds the runner on that many threads
(`start_threads`). While serving, the runner measures again about once a second between steps
and follows (`ServingThreads`). The bundled model gave the same tokens and logprobs, bit for
bit, on one thread and on two: the count changes speed, not outputs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The shortest window a start measures over (the model's resolve may take less: it waits out
# the rest); the counters tick 100 times a second a core.
SAMPLE_SECONDS = 0.1


@dataclass(frozen=True)
class CpuSnapshot:
    """The busy seconds of this process's cores (all processes), this process's own CPU
    seconds, and the wall clock, at one moment."""

    busy: float
    own: float
    wall: float
    cores: int


def _cores() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_busy_seconds(cores: set[int], path: str = "/proc/stat") -> float | None:
    """Seconds the given cores spent on anything but idle and I/O wait, from `path` (Linux's
    per-core counters, in clock ticks); None where there is no such file."""
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        fields = [int(v) for v in rest.split()]
        ticks += sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def snapshot() -> CpuSnapshot | None:
    """Now's counters; None where the machine has no per-core counters to read."""
    cores = _cores()
    busy = read_busy_seconds(cores)
    if busy is None:
        return None
    return CpuSnapshot(busy, time.process_time(), time.monotonic(), len(cores))


def free_cores(before: CpuSnapshot, after: CpuSnapshot) -> float | None:
    """Cores that other processes left idle between the two snapshots (this process's own work
    counts as free); None for a window too short to tell."""
    wall = after.wall - before.wall
    if wall < 0.05:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return after.cores - max(0.0, others) / wall


def threads_for(configured: int, free: float | None) -> int:
    """The compute threads to run on: `configured`, or fewer where other work holds cores."""
    if free is None:
        return configured
    return max(1, min(configured, int(free + 0.5)))


def _free_since(before: CpuSnapshot | None) -> tuple[float | None, int]:
    """The cores others left free since `before` (now, when None) over at least
    SAMPLE_SECONDS, and the cores counted; None where the counters cannot tell."""
    before = before or snapshot()
    if before is None:
        return None, 0
    time.sleep(max(0.0, SAMPLE_SECONDS - (time.monotonic() - before.wall)))
    after = snapshot()
    if after is None:
        return None, 0
    return free_cores(before, after), after.cores


@contextlib.contextmanager
def start_threads(before: CpuSnapshot | None) -> Iterator[int]:
    """Run the block with as many torch threads as the cores that others leave free since
    `before` (or over a short sample without it); torch's count is restored after."""
    configured = torch.get_num_threads()
    free, cores = _free_since(before) if configured > 1 else (None, 0)
    threads = threads_for(configured, free)
    if threads < configured:
        logger.info(
            "Other processes keep %.1f of %d cores busy: the model starts with %d compute "
            "thread(s), then serves with %d",
            cores - (free or 0.0), cores, threads, configured,
        )  # fmt: skip
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if threads < configured:
            torch.set_num_threads(configured)


# Seconds between two measurements while serving, and the windows in a row that must agree
# before the count changes (a burst of other work does not flip it).
SERVING_WINDOW = 1.0
SERVING_AGREE = 2


class ServingThreads:
    """Between steps, keeps torch's compute threads at the cores other processes leave free,
    up to torch's count when it was made (after the start). Called from the model's thread."""

    def __init__(self, window: float = SERVING_WINDOW, agree: int = SERVING_AGREE) -> None:
        self.window = window
        self.agree = agree
        self.configured = self.current = torch.get_num_threads()
        self._last = snapshot() if self.configured > 1 else None
        self._wanted, self._votes = 0, 0

    def before_step(self) -> None:
        last = self._last
        if last is None or time.monotonic() - last.wall < self.window:
            return
        now = snapshot()
        if now is None:
            return
        free = free_cores(last, now)
        self._last = now
        wanted = threads_for(self.configured, free)
        if wanted == self.current:
            self._votes = 0
            return
        self._votes = self._votes + 1 if wanted == self._wanted else 1
        self._wanted = wanted
        if self._votes >= self.agree:
            logger.info(
                "Other processes keep %.1f of %d cores busy: %d compute thread(s) now (was %d)",
                now.cores - (free or 0.0), now.cores, wanted, self.current,
            )  # fmt: skip
            torch.set_num_threads(wanted)
            self.current, self._votes = wanted, 0
