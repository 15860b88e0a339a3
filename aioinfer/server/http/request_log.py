"""The request log: one line per generation request (status, token counts, finish reasons,
latency), and a second with the clipped texts under --log-prompts. `generation_handler` wraps
every generation handler: it counts the request in flight (shutdown waits for these) and writes
its line.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from aioinfer.core.outputs import CompletionOutput
from aioinfer.server.http.errors import APIError
from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.http.sse import CLIENT_CLOSED_REQUEST, ClientDisconnected
from aioinfer.server.http.state import STATE

logger = logging.getLogger(__name__)

# Under --log-prompts, the prompts and the outputs each logged (every one clipped to
# --max-log-len characters): a request of 4096 prompts would otherwise make one line of
# megabytes.
MAX_TEXTS_LOGGED = 16


class Started(Protocol):
    """What the log reads of a request once it started (a serving ResponseContext)."""

    @property
    def response_id(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...


@dataclass
class RequestRecord:
    """The request log line of one generation request. Texts are kept only with
    --log-prompts, and only as much of each as is logged (`max_text` characters, and one more
    to tell that it went on); API keys and headers are never part of it."""

    path: str
    keep_text: bool = False
    max_text: int = 2000  # characters of each prompt or output logged (--max-log-len)
    status: int | None = None
    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    prompt_texts: list[str | None] = field(default_factory=list)
    # Each sequence's output text so far, in pieces, up to max_text + 1 characters.
    outputs: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    _output_chars: dict[tuple[int, int], int] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    _more_prompts: int = 0  # prompts not kept, past MAX_TEXTS_LOGGED

    def start(self, ctx: Started, prompt_texts: list[str | None]) -> None:
        self.request_id = ctx.response_id
        self.prompt_tokens = ctx.prompt_tokens
        if self.keep_text:
            self.prompt_texts = _clip(prompt_texts[:MAX_TEXTS_LOGGED], self.max_text)
            self._more_prompts = max(len(prompt_texts) - MAX_TEXTS_LOGGED, 0)

    def add(self, prompt_index: int, seq: CompletionOutput) -> None:
        """Count one output delta (or a final output) of sequence `seq.index`."""
        self.completion_tokens += len(seq.token_ids)
        if seq.finish_reason is not None:
            self.finish_reasons.append(seq.finish_reason)
        if self.keep_text and seq.text:
            # Appending to the whole text so far was quadratic in the output's length.
            key = (prompt_index, seq.index)
            kept = self._output_chars.get(key, 0)
            if kept <= self.max_text:
                piece = seq.text[: self.max_text + 1 - kept]
                self.outputs.setdefault(key, []).append(piece)
                self._output_chars[key] = kept + len(piece)

    def log(self) -> None:
        elapsed = time.perf_counter() - self.started
        finish = ",".join(sorted(set(self.finish_reasons))) or "-"
        logger.info(
            "request %s %s: status %s, %d prompt + %d completion tokens, finish %s, %.3f s",
            self.request_id, self.path, self.status, self.prompt_tokens,
            self.completion_tokens, finish, elapsed,
        )  # fmt: skip
        if self.keep_text:
            keys = sorted(self.outputs)
            outputs = ["".join(self.outputs[k]) for k in keys[:MAX_TEXTS_LOGGED]]
            more_prompts = max(len(self.prompt_texts) - MAX_TEXTS_LOGGED, 0) + self._more_prompts
            more_outputs = max(len(keys) - MAX_TEXTS_LOGGED, 0)
            logger.info(
                "request %s text: prompts=%r%s outputs=%r%s",
                self.request_id, _clip(self.prompt_texts[:MAX_TEXTS_LOGGED], self.max_text),
                f" (and {more_prompts} more)" if more_prompts else "",
                _clip(outputs, self.max_text),
                f" (and {more_outputs} more)" if more_outputs else "",
            )  # fmt: skip


def _clip(texts: Sequence[str | None], limit: int) -> list[str | None]:
    return [t if t is None or len(t) <= limit else t[:limit] + "..." for t in texts]


def generation_handler(
    handler: Callable[[web.Request, RequestRecord], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Counts the request as in flight (shutdown waits for these) and writes its log line."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        config = state.config
        record = RequestRecord(
            request.path,
            keep_text=config.log_requests and config.log_prompts,
            max_text=config.max_log_len,
        )
        state.in_flight += 1
        try:
            response = await handler(request, record)
            if record.status is None:
                record.status = response.status
            return response
        except APIError as exc:
            record.status = exc.status
            raise
        except RequestValidationError:
            record.status = 400
            raise
        except ClientDisconnected:
            record.status = CLIENT_CLOSED_REQUEST
            raise
        finally:
            state.in_flight -= 1
            if config.log_requests:
                record.log()

    return wrapper
