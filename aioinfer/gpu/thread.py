"""GpuThread: THE boundary between the event loop and everything that touches torch.

The loop submits work (a StepPlan, or a setup call such as loading the model) and gets a
`concurrent.futures.Future` back; `asyncio.wrap_future` turns it into an awaitable that resolves
on the loop through `call_soon_threadsafe`. The thread never touches loop state.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from aioinfer.core.step import StepPlan, StepResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Test hook: the forward pass raises after this many steps (engine-fault tests); "N:hang"
# makes it block forever instead (watchdog tests).
FAULT_ENV = "AIOINFER_FAULT_AFTER_STEPS"
THREAD_NAME = "aioinfer-gpu"


class InjectedFault(RuntimeError):
    pass


class GpuThread:
    """One thread that owns the model runner. Work runs in submission order."""

    def __init__(self, name: str = THREAD_NAME) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.runner: Any = None  # set by the first call, on this thread
        # Steps launched and not collected yet, oldest first (touched on this thread only).
        self._launched: deque[Any] = deque()
        self._busy_since: float | None = None  # when the work it runs now started
        fault = os.environ.get(FAULT_ENV, "")
        steps, _, kind = fault.partition(":")
        self._steps_left_before_fault = int(steps) if steps else None
        self._fault_hangs = kind == "hang"
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn() on the GPU thread; its result or exception lands in the future."""
        future: Future[T] = Future()
        self._queue.put((fn, future))
        return future

    def create_runner(self, factory: Callable[[], Any]) -> Future[Any]:
        def build() -> Any:
            self.runner = factory()
            return self.runner

        return self.call(build)

    def execute(self, plan: StepPlan) -> Future[StepResult]:
        """Run one step; its result when it is done."""
        return self.call(lambda: self._collect(self._launch(plan)))

    def launch(self, plan: StepPlan) -> Future[None]:
        """Queue a step on the device (the runner's `launch`); `collect` gives its result. The
        loop may launch the next step before collecting this one: the device then has it queued
        when this one ends."""
        return self.call(lambda: self._launched.append(self._launch(plan)))

    @property
    def launch_is_async(self) -> bool:
        """Whether the runner's launch returns before the device has run the step (CUDA). A
        runner that computes in launch (the CPU) must have the last step collected first."""
        return bool(getattr(self.runner, "launch_is_async", False))

    def collect(self) -> Future[StepResult]:
        """The result of the oldest step launched and not collected: waits for the device."""
        return self.call(lambda: self._collect(self._launched.popleft()))

    def _launch(self, plan: StepPlan) -> Any:
        if self._steps_left_before_fault is not None:
            if self._steps_left_before_fault <= 0:
                if self._fault_hangs:
                    threading.Event().wait()
                raise InjectedFault(f"fault injected by {FAULT_ENV}")
            self._steps_left_before_fault -= 1
        launch = getattr(self.runner, "launch", None)
        # A runner without launch/finish (a test's stand-in) runs the whole step at once.
        return self.runner.execute(plan) if launch is None else launch(plan)

    def _collect(self, launched: Any) -> StepResult:
        finish = getattr(self.runner, "finish", None)
        return launched if finish is None else finish(launched)

    def busy_seconds(self) -> float:
        """How long the work the thread runs now has been running; 0 while it waits."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def stop(self, timeout: float | None = 10.0) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _main(self) -> None:
        # Grad mode is per thread: this is where inference mode must be entered.
        with torch.inference_mode():
            while (item := self._queue.get()) is not None:
                self._run(*item)
        self._release_runner()

    def _run(self, fn: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        self._busy_since = time.monotonic()
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the loop, which fails the requests
            logger.debug("GPU thread work failed", exc_info=True)
            future.set_exception(exc)
        finally:
            self._busy_since = None

    def _release_runner(self) -> None:
        """Drop the runner so its weights, KV cache and CUDA graphs are freed, and hand the
        cached blocks back to the device: a second engine in this process needs the memory."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        self.runner = None
        gc.collect()  # reference cycles among the model's modules would keep its tensors alive
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
