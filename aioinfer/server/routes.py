"""Thin handlers: parse the request, hand it to the engine, answer with JSON or SSE.

Everything that can be refused is refused before the engine sees the request (a 400 names the
field); once the request is admitted, leaving the output iteration for any reason (client gone,
handler cancelled, engine failure) aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aioinfer import __version__
from aioinfer.config import ServerConfig
from aioinfer.core.outputs import OutputAccumulator, RequestOutput
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.stream import EngineDeadError, RequestStream
from aioinfer.server import protocol
from aioinfer.server.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    error_body,
)
from aioinfer.server.metrics import RequestTimer, ServerMetrics
from aioinfer.server.protocol import Prompt, ResponseContext, StreamOptionsView
from aioinfer.server.sse import ClientDisconnected, DisconnectWatcher, EventStream

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

MiB = 1 << 20
# The body limit follows the context length: 64 bytes per token covers a token-id list (at most
# ~8 bytes per id) and text escaped as \uXXXX (6 bytes per character, a few characters per
# token), with 1 MiB for the rest of the JSON. The floor lets batches of prompts through; the
# cap (also aiohttp's client_max_size) bounds what one request can make the server buffer.
MIN_BODY_BYTES = 16 * MiB
MAX_BODY_BYTES = 128 * MiB
BODY_BYTES_PER_TOKEN = 64
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


@dataclass
class ServerState:
    """What the handlers share; lives in `app[STATE]`."""

    config: ServerConfig
    watcher: DisconnectWatcher = field(default_factory=DisconnectWatcher)
    engine: AsyncEngine | None = None
    startup_error: BaseException | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Set once the engine serves, or failed to start.
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    metrics: ServerMetrics = field(init=False)
    _token_texts: dict[int, str] = field(default_factory=dict)
    _openapi: bytes | None = None

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.engine)

    def set_engine(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._token_texts.clear()
        self.ready.set()

    def set_startup_error(self, error: BaseException) -> None:
        self.startup_error = error
        self.ready.set()

    def unavailable_reason(self) -> str | None:
        """Why the server cannot take requests now, or None when it can."""
        if self.draining:
            return "The server is shutting down"
        if self.startup_error is not None:
            return f"The engine failed to start: {self.startup_error!r}"
        if self.engine is None or not self.engine.ready:
            return "The engine is loading; retry when /health answers 200"
        if self.engine.dead_error is not None:
            return f"The engine failed: {self.engine.dead_error!r}"
        return None

    def serving_engine(self) -> AsyncEngine:
        reason = self.unavailable_reason()
        if reason is not None:
            raise ServiceUnavailableError(reason, headers={"Retry-After": "5"})
        assert self.engine is not None
        return self.engine

    def token_text(self, tokenizer: Any) -> Callable[[int], str]:
        """Decoded text of one token id, cached (logprobs ask for the same ids again and again)."""
        cache = self._token_texts

        def text(token_id: int) -> str:
            value = cache.get(token_id)
            if value is None:
                value = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
            return value

        return text

    def openapi(self) -> bytes:
        if self._openapi is None:
            self._openapi = orjson.dumps(protocol.openapi_document(__version__))
        return self._openapi


STATE = web.AppKey("aioinfer_state", ServerState)


def setup_routes(app: web.Application) -> None:
    router = app.router
    router.add_get("/health", health)
    router.add_get("/version", version)
    router.add_get("/metrics", metrics)
    router.add_get("/openapi.json", openapi)
    router.add_get("/v1/models", list_models)
    router.add_get("/v1/models/{model}", retrieve_model)
    router.add_post("/v1/completions", create_completion)
    router.add_post("/v1/chat/completions", create_chat_completion)
    router.add_post("/tokenize", tokenize)
    router.add_post("/detokenize", detokenize)


# --------------------------------------------------------------------------- plain endpoints


async def health(request: web.Request) -> web.Response:
    reason = request.app[STATE].unavailable_reason()
    if reason is not None:
        raise ServiceUnavailableError(reason)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].openapi(), content_type="application/json")


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.serving_engine()
    card = protocol.model_card(engine.model_name, engine.max_model_len, state.created)
    return json_response({"object": "list", "data": [card]})


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.serving_engine()
    check_model(request.match_info["model"], engine)
    card = protocol.model_card(engine.model_name, engine.max_model_len, state.created)
    return json_response(card)


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[STATE].serving_engine()
    req = protocol.TokenizeRequest.parse(await read_json(request, body_limit(engine)))
    check_model(req.model, engine)
    if req.messages is not None:
        messages = [m.to_template() for m in req.messages]
        ids = render_chat(engine.tokenizer, messages, req.add_generation_prompt is not False)
    else:
        special = req.add_special_tokens is not False
        ids = list(engine.tokenizer(req.prompt, add_special_tokens=special)["input_ids"])
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[STATE].serving_engine()
    req = protocol.DetokenizeRequest.parse(await read_json(request, body_limit(engine)))
    check_model(req.model, engine)
    vocab = int(engine.info.vocab_size)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequestError(f"tokens must be in [0, {vocab}), got {bad[0]}", param="tokens")
    return json_response({"prompt": engine.tokenizer.decode(req.tokens)})


# --------------------------------------------------------------------------- generation


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.serving_engine()
    req = protocol.CompletionRequest.parse(await read_json(request, body_limit(engine)))
    check_model(req.model, engine)
    prompts = encode_prompts(engine.tokenizer, req.prompt)
    params = req.to_sampling_params(engine.default_sampling)
    ctx = ResponseContext(
        f"cmpl-{uuid.uuid4().hex}",
        engine.model_name,
        prompts,
        params.n,
        state.token_text(engine.tokenizer),
    )
    echo_texts = None
    if req.echo:
        decode = engine.tokenizer.decode
        echo_texts = [ctx.prompt_text(i, decode) for i in range(len(prompts))]
    want_logprobs = req.logprobs is not None
    generation = start_generation(
        state, engine, ctx, params, clamp_max_tokens=not req.max_tokens_given
    )
    if req.stream:
        chunks = protocol.CompletionChunks(
            ctx, _stream_options(req), echo_texts=echo_texts, want_logprobs=want_logprobs
        )
        return await stream_response(request, state, generation, chunks)
    finals = await collect(request, state, generation)
    if finals is None:
        return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")
    body = protocol.completion_response(
        ctx, finals, echo_texts=echo_texts, want_logprobs=want_logprobs
    )
    return json_response(body)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.serving_engine()
    req = protocol.ChatCompletionRequest.parse(await read_json(request, body_limit(engine)))
    check_model(req.model, engine)
    add_generation_prompt = req.add_generation_prompt is not False
    ids = render_chat(engine.tokenizer, req.template_messages(), add_generation_prompt)
    params = req.to_sampling_params(engine.default_sampling)
    ctx = ResponseContext(
        f"chatcmpl-{uuid.uuid4().hex}",
        engine.model_name,
        [Prompt(ids)],
        params.n,
        state.token_text(engine.tokenizer),
    )
    generation = start_generation(
        state, engine, ctx, params, clamp_max_tokens=not req.max_tokens_given, what="messages"
    )
    want_logprobs = bool(req.logprobs)
    if req.stream:
        chunks = protocol.ChatChunks(ctx, _stream_options(req), want_logprobs=want_logprobs)
        return await stream_response(request, state, generation, chunks)
    finals = await collect(request, state, generation)
    if finals is None:
        return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")
    return json_response(protocol.chat_response(ctx, finals[0], want_logprobs=want_logprobs))


class Generation:
    """The engine requests of one HTTP request (one per prompt) and their merged outputs."""

    def __init__(
        self, engine: AsyncEngine, streams: list[RequestStream], timers: list[RequestTimer]
    ) -> None:
        self.engine = engine
        self.streams = streams
        self.timers = timers

    async def deltas(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, delta) as they arrive. Leaving early aborts every unfinished request."""
        source = self._single() if len(self.streams) == 1 else self._merged()
        try:
            async with contextlib.aclosing(source) as items:
                async for item in items:
                    yield item
        finally:
            self.abort_unfinished()

    async def _single(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        stream, timer = self.streams[0], self.timers[0]
        while True:
            output = await stream.get()
            timer.observe(output)
            yield 0, output
            if output.finished:
                return

    async def _merged(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        pending = {asyncio.ensure_future(s.get()): i for i, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=pending.__getitem__):
                    index = pending.pop(future)
                    output = future.result()
                    self.timers[index].observe(output)
                    yield index, output
                    if not output.finished:
                        pending[asyncio.ensure_future(self.streams[index].get())] = index
        finally:
            for future in pending:
                if future.done():
                    if not future.cancelled():
                        future.exception()  # retrieved: no "never retrieved" warning
                else:
                    future.cancel()

    async def finals(self) -> list[RequestOutput]:
        accumulators = [OutputAccumulator(s.n) for s in self.streams]
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for index, output in deltas:
                accumulators[index].add(output)
        return [a.result() for a in accumulators]

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            if not stream.taken_final:
                self.engine.abort(stream.request_id)


def start_generation(
    state: ServerState,
    engine: AsyncEngine,
    ctx: ResponseContext,
    params: SamplingParams,
    *,
    clamp_max_tokens: bool,
    what: str = "prompt",
) -> Generation:
    """Admit one engine request per prompt, all or none. A default max_tokens (not the
    client's) shrinks to what the context leaves."""
    check_queue(engine, len(ctx.prompts) * params.n)
    streams: list[RequestStream] = []
    try:
        for index, prompt in enumerate(ctx.prompts):
            prompt_params = params
            room = engine.max_model_len - len(prompt.token_ids)
            if clamp_max_tokens and params.max_tokens is not None and 1 <= room < params.max_tokens:
                prompt_params = params.clone(max_tokens=room)
            request_id = ctx.response_id if len(ctx.prompts) == 1 else f"{ctx.response_id}-{index}"
            streams.append(
                engine.add_request(prompt.token_ids, prompt_params, request_id, prompt.text)
            )
    except BaseException as exc:
        for stream in streams:
            engine.abort(stream.request_id)
        if isinstance(exc, EngineDeadError):
            raise ServiceUnavailableError(f"The engine failed: {exc}") from None
        if isinstance(exc, ValueError):
            raise BadRequestError(str(exc), param=_engine_param(str(exc), what)) from None
        raise
    timers = [state.metrics.timer(engine.model_name) for _ in streams]
    return Generation(engine, streams, timers)


async def collect(
    request: web.Request, state: ServerState, generation: Generation
) -> list[RequestOutput] | None:
    """The final outputs, or None when the client left first."""
    try:
        return await state.watcher.guard(request, generation.finals())
    except ClientDisconnected:
        logger.info("client left; aborted %s", generation.streams[0].request_id)
        return None
    except EngineDeadError as exc:
        raise InternalServerError(f"The engine failed while generating: {exc}") from None
    finally:
        generation.abort_unfinished()


async def stream_response(
    request: web.Request,
    state: ServerState,
    generation: Generation,
    chunks: protocol.CompletionChunks | protocol.ChatChunks,
) -> web.StreamResponse:
    """Stream the chunks as SSE. After the 200 went out, a failure is reported in band as an
    error event, followed by [DONE]."""
    try:
        events = await EventStream.open(request)
    except ClientDisconnected:
        generation.abort_unfinished()
        return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")

    async def pump() -> None:
        await events.send(chunks.opening())
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for index, output in deltas:
                await events.send(chunks.delta(index, output))
        await events.send(chunks.closing())
        await events.send_done()

    try:
        await state.watcher.guard(request, pump())
    except ClientDisconnected:
        logger.info("client left; aborted %s", generation.streams[0].request_id)
        return events.response
    except Exception as exc:
        if isinstance(exc, EngineDeadError):
            message = f"The engine failed while generating: {exc}"
        else:
            logger.exception("streaming %s failed", generation.streams[0].request_id)
            message = "Internal server error"
        with contextlib.suppress(ClientDisconnected):
            await events.send([error_body(500, message)])
            await events.send_done()
    finally:
        generation.abort_unfinished()
    await events.finish()
    return events.response


def _stream_options(
    req: protocol.CompletionRequest | protocol.ChatCompletionRequest,
) -> StreamOptionsView:
    return StreamOptionsView(req.include_usage, req.continuous_usage)


# --------------------------------------------------------------------------- helpers


def json_response(body: Mapping[str, Any], status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def body_limit(engine: AsyncEngine) -> int:
    by_context = MiB + BODY_BYTES_PER_TOKEN * engine.max_model_len
    return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, by_context))


async def read_json(request: web.Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else, 413 beyond `limit` bytes."""
    if request.content_type != "application/json":
        raise BadRequestError(
            "Unsupported Media Type: only 'application/json' is allowed, got "
            f"{request.content_type!r}"
        )
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise BadRequestError(f"The body must be UTF-8, got charset {charset!r}")
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLargeError(_too_large(length, limit))
    body = await request.read()
    if len(body) > limit:
        raise PayloadTooLargeError(_too_large(len(body), limit))
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"The body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        kind = "an array" if isinstance(data, list) else f"a {type(data).__name__}"
        raise BadRequestError(f"The body must be a JSON object, got {kind}")
    return data


def _too_large(size: int, limit: int) -> str:
    return f"Request body too large: {size} bytes, the limit is {limit} bytes"


def check_model(name: str | None, engine: AsyncEngine) -> None:
    if name and name != engine.model_name:
        raise NotFoundError(
            f"The model `{name}` does not exist. Valid models: {engine.model_name}.",
            param="model",
        )


def check_queue(engine: AsyncEngine, num_new: int) -> None:
    """503 when admitting `num_new` sequences would exceed --max-queued-requests."""
    limit = engine.scheduler_config.max_queued_requests
    if limit is None or engine.scheduler is None:
        return
    waiting = engine.scheduler.num_waiting
    if waiting + num_new > limit:
        raise ServiceUnavailableError(
            f"The server is overloaded: {waiting} requests are waiting and the limit is {limit} "
            "(--max-queued-requests); retry later",
            headers={"Retry-After": "1"},
        )


def encode_prompts(
    tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[Prompt]:
    """One Prompt per text or token-id list (the shapes were checked by the protocol)."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt[0], str):
        texts = prompt
    elif isinstance(prompt[0], int):
        return [Prompt(list(prompt))]
    else:
        return [Prompt(list(ids)) for ids in prompt]
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [Prompt(list(ids), text) for ids, text in zip(encoded, texts, strict=True)]


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    """Prompt token ids of chat messages, through the model's chat template."""
    import jinja2

    from aioinfer.engine.tokenizer import apply_chat_template

    try:
        return apply_chat_template(
            tokenizer, list(messages), add_generation_prompt=add_generation_prompt
        )
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise BadRequestError(f"The chat template failed: {exc}", param="messages") from None


_ENGINE_PARAMS = ("max_tokens", "logprobs", "prompt_logprobs", "logit_bias", "min_tokens")


def _engine_param(message: str, default: str) -> str:
    """The field an engine ValueError is about (its messages name the field)."""
    first = message.split(" ", 1)[0]
    if first in _ENGINE_PARAMS:
        return first
    if "max_tokens" in message or "you requested" in message:
        return "max_tokens"
    return default
