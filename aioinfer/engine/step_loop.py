"""The scheduler coroutine: schedule -> run on the GPU thread -> apply -> fan out, forever.

With overlap (--async-scheduling, the default), step N+1 is planned and queued on the GPU thread
before step N's result is applied, wherever the scheduler allows it (Scheduler.can_plan_ahead):
the device finds the next step waiting, and the loop applies and fans out N while N+1 runs.

It is the only code that mutates scheduler state while the engine runs; aborts from handlers
are plain calls on the same loop, so they interleave between steps, never inside one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from aioinfer.core.scheduler import RequestUpdate, Scheduler
from aioinfer.core.step import StepPlan, StepResult
from aioinfer.engine.stats import EngineStats
from aioinfer.gpu.thread import GpuThread

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class StepTimeoutError(RuntimeError):
    """A step ran past the watchdog's limit: the GPU thread is stuck (a hung kernel or
    device), and no request can make progress."""


@dataclass(frozen=True)
class _InFlight:
    """A step queued on the GPU thread, not applied yet."""

    plan: StepPlan
    launched: Future[None]  # the GPU thread's launch of it
    start: float  # perf_counter() when it was queued


class StepLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        gpu: GpuThread,
        on_updates: Callable[[list[RequestUpdate]], None],
        on_fatal: Callable[[BaseException], None],
        before_step: Callable[[], object] | None = None,
        step_timeout: float | None = None,
        stats: EngineStats | None = None,
        overlap: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.gpu = gpu
        self.on_updates = on_updates
        self.on_fatal = on_fatal
        # Runs before each plan is built (e.g. dropping requests that waited too long).
        self.before_step = before_step
        # The watchdog: a step that runs longer kills the engine (None: no limit). The stuck
        # thread cannot be stopped; the process exits around it.
        self.step_timeout = step_timeout
        self.stats = stats  # its histogram of tokens per step
        # Plan and queue step N+1 while N runs, where the scheduler allows it (--async-scheduling).
        self.overlap = overlap
        self.wakeup = asyncio.Event()
        self.num_steps = 0
        self.on_step: Callable[[StepPlan, StepResult, float], None] | None = None

    def notify(self) -> None:
        """New work arrived: wake the loop if it sleeps."""
        self.wakeup.set()

    async def run(self) -> None:
        try:
            in_flight: _InFlight | None = None
            while True:
                if in_flight is None:
                    if not self.scheduler.has_work():
                        self.wakeup.clear()
                        await self.wakeup.wait()
                        continue
                    in_flight = self._launch_next()
                    if in_flight is None:
                        # Everything left waits for blocks that running requests hold.
                        await asyncio.sleep(0)
                        continue
                if not (self.overlap and self.scheduler.can_plan_ahead(in_flight.plan)):
                    await self._finish(in_flight, self.gpu.collect())
                    in_flight = None
                    continue
                # Plan the next step while the device runs this one. A GPU gets it queued
                # behind this one, so it never waits; a CPU computes it in launch, so the
                # result of this one is collected first and applied while it computes.
                if self.gpu.launch_is_async:
                    following = self._launch_next()
                    collected = self.gpu.collect()
                else:
                    collected = self.gpu.collect()
                    following = self._launch_next()
                await self._finish(in_flight, collected)
                in_flight = following
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("engine step failed; failing every in-flight request")
            self.on_fatal(exc)

    def _launch_next(self) -> _InFlight | None:
        """Plan the next step and queue it on the GPU thread; None when there is nothing to
        run now."""
        if self.before_step is not None:
            self.before_step()
        if not self.scheduler.has_work():
            return None
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        self._host_time("schedule", start)
        if not plan.chunks:
            return None
        return _InFlight(plan, self.gpu.launch(plan), time.perf_counter())

    async def _finish(self, step: _InFlight, collected: Future[StepResult]) -> None:
        """Wait for the step's result (`collected`), apply it and fan out the updates."""
        # A failed launch raises here, a stuck one trips the watchdog (the thread runs work in
        # order: the collect waits behind it).
        await self._run_on_gpu(step.launched)
        result = await self._run_on_gpu(collected)
        elapsed = time.perf_counter() - step.start
        self.num_steps += 1
        if self.stats is not None:
            self.stats.step_tokens.observe(step.plan.num_tokens)
        start = time.perf_counter()
        updates = self.scheduler.apply(step.plan, result)
        self._host_time("apply", start)
        if self.on_step is not None:
            self.on_step(step.plan, result, elapsed)
        start = time.perf_counter()
        self.on_updates(updates)
        self._host_time("fan_out", start)

    def _host_time(self, phase: str, start: float) -> None:
        if self.stats is not None:
            self.stats.add_host_time(phase, time.perf_counter() - start)

    async def _run_on_gpu(self, work: Future[_T]) -> _T:
        """The work's result; with the watchdog, a StepTimeoutError once the GPU thread has
        spent step_timeout seconds on one piece of work (this, or a step or a LoRA load queued
        before it: the clock starts when the work does)."""
        running = asyncio.wrap_future(work)
        timeout = self.step_timeout
        while not (await asyncio.wait((running,), timeout=timeout))[0]:
            assert self.step_timeout is not None
            busy = self.gpu.busy_seconds()
            if busy >= self.step_timeout:
                # The step may still end, or fail, long after: nobody will read it.
                running.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise StepTimeoutError(
                    f"an engine step ran for more than {self.step_timeout:g} s (watchdog "
                    f"timeout): the GPU thread is stuck"
                )
            timeout = self.step_timeout - busy
        return running.result()
