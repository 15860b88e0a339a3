"""The scheduler coroutine: schedule -> run on the GPU thread -> apply -> fan out, forever.

It is the only code that mutates scheduler state while the engine runs; aborts from handlers
are plain calls on the same loop, so they interleave between steps, never inside one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aioinfer.core.scheduler import RequestUpdate, Scheduler
from aioinfer.core.step import StepPlan, StepResult
from aioinfer.engine.stats import EngineStats
from aioinfer.gpu.thread import GpuThread

logger = logging.getLogger(__name__)


class StepTimeoutError(RuntimeError):
    """A step ran past the watchdog's limit: the GPU thread is stuck (a hung kernel or
    device), and no request can make progress."""


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
        self.wakeup = asyncio.Event()
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.on_step: Callable[[StepPlan, StepResult, float], None] | None = None

    def notify(self) -> None:
        """New work arrived: wake the loop if it sleeps."""
        self.wakeup.set()

    async def run(self) -> None:
        try:
            while True:
                if not self.scheduler.has_work():
                    self.wakeup.clear()
                    await self.wakeup.wait()
                    continue
                await self.step()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("engine step failed; failing every in-flight request")
            self.on_fatal(exc)

    async def step(self) -> None:
        if self.before_step is not None:
            self.before_step()
            if not self.scheduler.has_work():
                return
        plan = self.scheduler.schedule()
        if not plan.chunks:
            # Everything left is waiting for blocks that running requests hold: yield a tick.
            await asyncio.sleep(0)
            return
        start = time.perf_counter()
        result = await self._run_on_gpu(plan)
        elapsed = time.perf_counter() - start
        self.num_steps += 1
        self.busy_seconds += elapsed
        if self.stats is not None:
            self.stats.step_tokens.observe(plan.num_tokens)
        updates = self.scheduler.apply(plan, result)
        if self.on_step is not None:
            self.on_step(plan, result, elapsed)
        self.on_updates(updates)

    async def _run_on_gpu(self, plan: StepPlan) -> StepResult:
        """The step's result; with the watchdog, a StepTimeoutError once the GPU thread has
        spent step_timeout seconds on one piece of work (the step, or a LoRA load queued
        before it: the clock starts when the work does)."""
        running = asyncio.wrap_future(self.gpu.execute(plan))
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
