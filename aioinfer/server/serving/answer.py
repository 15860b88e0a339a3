"""How a generation request is answered once the engine has it: one JSON body built from the
final outputs, or SSE events built from the output deltas as they come, with keep-alive
comments while nothing moves. Leaving either for any reason (client gone, handler cancelled,
engine failure) aborts what is unfinished; a failure before the first write is a plain HTTP
error, after it an error event.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.http.bodies import json_response
from aioinfer.server.http.errors import InternalServerError, error_body
from aioinfer.server.http.request_log import RequestRecord
from aioinfer.server.http.sse import ClientDisconnected, EventStream, client_closed, encode_event
from aioinfer.server.http.state import ServerState
from aioinfer.server.serving.generation import Generation, generation_error

logger = logging.getLogger(__name__)

BodyBuilder = Callable[[list[RequestOutput]], Mapping[str, Any]]


class Chunks(Protocol):
    """The events of one streamed response, built from the engine's output deltas."""

    def opening(self) -> list[Any]:
        """The events before the first delta's own."""

    def delta(self, prompt_index: int, output: RequestOutput) -> list[Any]: ...

    def closing(self) -> list[Any]:
        """The events after the last delta's own."""


@dataclass(frozen=True)
class Framing:
    """How a stream is written: `encode` frames one event; `done` ends the stream with
    [DONE]; `error` is the event of a failure after the stream started."""

    encode: Callable[[Any], bytes]
    done: bool
    error: Callable[[int, str], Any]


# Completions and chat completions: `data:` events, an error body in band, then [DONE].
CHUNK_FRAMING = Framing(encode_event, done=True, error=error_body)


async def answer(
    request: web.Request,
    state: ServerState,
    generation: Generation,
    record: RequestRecord,
    chunks: Chunks | None,
    body: BodyBuilder,
    framing: Framing = CHUNK_FRAMING,
) -> web.StreamResponse:
    """SSE chunks when the request asked for a stream (`chunks` is given), else the JSON body
    that `body` builds from the final outputs."""
    if chunks is not None:
        return await stream_response(request, state, generation, chunks, record, framing)
    finals = await collect(request, state, generation, record)
    if finals is None:
        return client_closed()
    return json_response(body(finals))


async def collect(
    request: web.Request, state: ServerState, generation: Generation, record: RequestRecord
) -> list[RequestOutput] | None:
    """The final outputs, or None when the client left first."""
    reason = "cancelled"
    try:
        finals = await state.watcher.guard(request, generation.finals())
    except ClientDisconnected as exc:
        reason = exc.reason
        logger.info("client left; aborted %s", generation.streams[0].request_id)
        return None
    except Exception as exc:
        error = generation_error(exc)
        if error is None:
            raise
        raise error from None
    finally:
        generation.abort_unfinished(reason)
    for prompt_index, final in enumerate(finals):
        for seq in final.outputs:
            record.add(prompt_index, seq)
    return finals


async def stream_response(
    request: web.Request,
    state: ServerState,
    generation: Generation,
    chunks: Chunks,
    record: RequestRecord,
    framing: Framing = CHUNK_FRAMING,
) -> web.StreamResponse:
    """Stream the chunks as SSE, with keep-alive comments while nothing moves. A failure
    before the first write is a plain HTTP error; after it, an error event (and [DONE])."""
    config = state.config
    events = EventStream(request, config.stream_write_timeout, framing.encode)
    stats = generation.engine.stats

    async def pump() -> None:
        opened = False
        deltas = generation.deltas(idle=config.sse_keep_alive_interval)
        async with contextlib.aclosing(deltas) as items:
            async for item in items:
                if item is None:
                    await events.send_keep_alive()
                    continue
                start = time.perf_counter()
                index, output = item
                payloads = [] if opened else chunks.opening()
                opened = True
                payloads.extend(chunks.delta(index, output))
                for seq in output.outputs:
                    record.add(index, seq)
                await events.send(payloads)  # returns at once unless the socket is full
                stats.add_host_time("http_write", time.perf_counter() - start)
        await events.send(chunks.closing())
        if framing.done:
            await events.send_done()

    reason = "cancelled"
    try:
        await state.watcher.guard(request, pump())
    except ClientDisconnected as exc:
        reason = exc.reason
        logger.info("client left (%s); aborted %s", reason, generation.streams[0].request_id)
        if not events.started:
            return client_closed()
        return events.response
    except Exception as exc:
        reason = "error"
        error = generation_error(exc)
        if error is None:
            logger.exception("streaming %s failed", generation.streams[0].request_id)
            error = InternalServerError("Internal server error")
        if not events.started:
            raise error from None
        record.status = error.status
        with contextlib.suppress(ClientDisconnected):
            await events.send([framing.error(error.status, error.message)])
            if framing.done:
                await events.send_done()
    finally:
        generation.abort_unfinished(reason)
    await events.finish()
    return events.response
