"""Per-request output collector: the scheduler coroutine puts deltas, the consumer gets them.

When the producer outruns the consumer (a slow HTTP client), deltas are merged rather than
queued, so memory stays bounded by one pending delta per sequence. The consumer is woken at
every delta, every `interval` tokens (vLLM's --stream-interval), or only when a sequence
finishes (`final_only()`: whoever waits wants the whole answer, not each token).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from aioinfer.core.outputs import CompletionOutput, RequestOutput
from aioinfer.core.step import TokenLogprobs

_T = TypeVar("_T")


class EngineDeadError(RuntimeError):
    """The engine failed (e.g. the forward pass raised); every in-flight request gets this."""


class EngineOverloadedError(RuntimeError):
    """Admitting the request would exceed --max-queued-requests; nothing was admitted."""


class QueueTimeoutError(RuntimeError):
    """The request waited longer than --queue-timeout for its first step and was dropped."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (a shutdown) before it produced what its caller awaits."""


class RequestStream:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        n: int,
        prompt_only: bool = False,
        interval: int = 1,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.n = n
        self.prompt_only = prompt_only  # echo with max_tokens 0: its one token stays hidden
        self.num_finished = 0
        self.num_cached_tokens = 0
        self._pending: dict[int, CompletionOutput] = {}
        self._prompt_logprobs: list[TokenLogprobs | None] | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        # Tokens a sequence gathers before its consumer is woken; None: only when it finishes.
        # A sequence's first delta always wakes it (time to first token).
        self.interval: int | None = interval
        self._delivered: set[int] = set()  # sequences whose first delta was taken
        self._idle_wake = False  # get_within's timer set _ready, not news
        self.taken_final = False
        # An embedding request's folded pooled parts (core/pooling.py), set when it finishes.
        self.pooled: Any = None

    @property
    def finished(self) -> bool:
        return self.num_finished >= self.n

    def put(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None,
        cumulative_logprob: float | None,
        finish_reason: str | None,
        stop_reason: int | str | None = None,
    ) -> None:
        pending = self._pending.get(index)
        if pending is None:
            self._pending[index] = CompletionOutput(
                index, text, list(token_ids), cumulative_logprob,
                list(logprobs) if logprobs is not None else None, finish_reason, stop_reason,
            )  # fmt: skip
        else:
            pending.text += text
            pending.token_ids.extend(token_ids)
            if logprobs is not None:
                if pending.logprobs is None:
                    pending.logprobs = list(logprobs)
                else:  # our own list: extended in place, not copied at every step
                    pending.logprobs.extend(logprobs)
            pending.cumulative_logprob = cumulative_logprob
            pending.finish_reason = finish_reason
            pending.stop_reason = stop_reason
        if finish_reason is not None:
            self.num_finished += 1
            self._ready.set()
        elif self.interval == 1 or self._due(index):  # 1, the default: every token
            self._ready.set()

    def _due(self, index: int) -> bool:
        """Whether sequence `index`'s unfinished delta wakes a consumer that gathers tokens
        (or waits for the end): at its first delta, then every `interval` tokens."""
        interval = self.interval
        if interval is None:
            return False
        return index not in self._delivered or len(self._pending[index].token_ids) >= interval

    def final_only(self) -> None:
        """Wake the consumer only when a sequence finishes (or the request fails): it merges
        the deltas into whole answers anyway."""
        self.interval = None

    def put_prompt_logprobs(self, logprobs: list[TokenLogprobs]) -> None:
        self._prompt_logprobs = [None, *logprobs]

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The deltas since the last get, merged. Raises the engine's error, if any."""
        await self._ready.wait()
        return self._take()

    async def get_within(self, timeout: float | None) -> RequestOutput | None:
        """Like get(), but None when `timeout` seconds pass with nothing new (None: no limit).
        The timer is a plain callback that wakes the wait, not asyncio.timeout's cancellation
        machinery: a stream waits once per token."""
        if timeout is None or self._ready.is_set():
            return await self.get()
        woken = asyncio.get_running_loop().call_later(timeout, self._wake_idle)
        try:
            await self._ready.wait()
        finally:
            woken.cancel()
        if self._idle_wake:
            self._idle_wake = False
            if not self._has_news():
                self._ready.clear()
                return None
        return self._take()

    def _wake_idle(self) -> None:
        self._idle_wake = True
        self._ready.set()

    def _has_news(self) -> bool:
        return bool(self._pending) or self._error is not None or self._prompt_logprobs is not None

    def _take(self) -> RequestOutput:
        if self._error is not None:
            raise self._error
        self._ready.clear()
        outputs = [self._pending[i] for i in sorted(self._pending)]
        if self.interval != 1:
            self._delivered.update(self._pending)
        self._pending = {}
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        finished = self.finished
        self.taken_final = finished
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            prompt_logprobs,
            self.num_cached_tokens,
        )


async def gather_or_cancel(awaitables: Iterable[Awaitable[_T]]) -> list[_T]:
    """The results in order, as asyncio.gather; but when one fails, or the caller is
    cancelled, the others are cancelled and awaited too: none is left running unwatched."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


if sys.version_info >= (3, 11):

    async def wait_event(event: asyncio.Event, timeout: float) -> bool:
        """Whether `event` was set within `timeout` seconds. A timer, not a task, per wait."""
        if event.is_set():
            return True
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        return True

else:

    async def wait_event(event: asyncio.Event, timeout: float) -> bool:
        """Whether `event` was set within `timeout` seconds."""
        if event.is_set():
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
