"""Thin handlers: parse the request, hand it to the engine, answer with JSON or SSE.

Everything that can be refused is refused before the engine sees the request (a 400 names the
field); once the request is admitted, leaving the output iteration for any reason (client gone,
handler cancelled, engine failure) aborts it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import itertools
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aioinfer import __version__
from aioinfer.config import ServerConfig
from aioinfer.core.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.stream import (
    EngineDeadError,
    EngineOverloadedError,
    QueueTimeoutError,
    RequestStream,
)
from aioinfer.server import protocol
from aioinfer.server.errors import (
    APIError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    error_body,
)
from aioinfer.server.metrics import RequestTimer, ServerMetrics
from aioinfer.server.protocol import (
    Prompt,
    RequestValidationError,
    ResponseContext,
    StreamOptionsView,
)
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
# Bounds the engine requests one HTTP request can create (prompts x n), checked before any
# tokenization; n alone is also bounded by --max-num-seqs.
MAX_SEQUENCES_PER_REQUEST = 4096
RETRY_AFTER = "1"  # seconds, on 503s of a full or slow queue
MAX_LOGGED_TEXT = 2000  # characters of each prompt or output in the request log
# Deeper JSON is refused before parsing: the JSON parser recurses per level (a body of a few MB
# of brackets overflows its stack), and no request needs more than a handful of levels.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN, _CLOSE = b"[{", b"]}"
# Brackets become +1 / -1 (as signed bytes); every other byte is deleted.
_BRACKETS = bytes.maketrans(_OPEN + _CLOSE, b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(_OPEN + _CLOSE))


@dataclass
class ServerState:
    """What the handlers share; lives in `app[STATE]`."""

    config: ServerConfig
    watcher: DisconnectWatcher = field(default_factory=DisconnectWatcher)
    engine: AsyncEngine | None = None
    startup_error: BaseException | None = None
    draining: bool = False
    in_flight: int = 0  # generation requests being answered; shutdown waits for them
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


@dataclass
class RequestRecord:
    """The request log line of one generation request. Texts are kept only with
    --log-prompts; API keys and headers are never part of it."""

    path: str
    keep_text: bool = False
    status: int | None = None
    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    prompt_texts: list[str | None] = field(default_factory=list)
    outputs: dict[tuple[int, int], str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def start(self, ctx: ResponseContext, prompt_texts: list[str | None]) -> None:
        self.request_id = ctx.response_id
        self.prompt_tokens = ctx.prompt_tokens
        if self.keep_text:
            self.prompt_texts = prompt_texts

    def add(self, prompt_index: int, seq: CompletionOutput) -> None:
        """Count one output delta (or a final output) of sequence `seq.index`."""
        self.completion_tokens += len(seq.token_ids)
        if seq.finish_reason is not None:
            self.finish_reasons.append(seq.finish_reason)
        if self.keep_text:
            key = (prompt_index, seq.index)
            self.outputs[key] = self.outputs.get(key, "") + seq.text

    def log(self) -> None:
        elapsed = time.perf_counter() - self.started
        finish = ",".join(sorted(set(self.finish_reasons))) or "-"
        logger.info(
            "request %s %s: status %s, %d prompt + %d completion tokens, finish %s, %.3f s",
            self.request_id, self.path, self.status, self.prompt_tokens,
            self.completion_tokens, finish, elapsed,
        )  # fmt: skip
        if self.keep_text:
            outputs = [self.outputs[k] for k in sorted(self.outputs)]
            logger.info(
                "request %s text: prompts=%r outputs=%r",
                self.request_id, _clip(self.prompt_texts), _clip(outputs),
            )  # fmt: skip


def _clip(texts: Sequence[str | None]) -> list[str | None]:
    return [t if t is None or len(t) <= MAX_LOGGED_TEXT else t[:MAX_LOGGED_TEXT] + "..."
            for t in texts]  # fmt: skip


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


def generation_handler(
    handler: Callable[[web.Request, RequestRecord], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Counts the request as in flight (shutdown waits for these) and writes its log line."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        config = state.config
        record = RequestRecord(request.path, keep_text=config.log_requests and config.log_prompts)
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
        finally:
            state.in_flight -= 1
            if config.log_requests:
                record.log()

    return wrapper


@generation_handler
async def create_completion(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.serving_engine()
    req = protocol.CompletionRequest.parse(await read_json(request, body_limit(engine)))
    check_model(req.model, engine)
    params = req.to_sampling_params(engine.default_sampling)
    admit(engine, count_prompts(req.prompt), params.n)
    # From here to the engine's admission there is no await: the admission check holds.
    prompts = encode_prompts(engine.tokenizer, req.prompt)
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
    record.start(ctx, [p.text for p in prompts])
    if req.stream:
        chunks = protocol.CompletionChunks(
            ctx, _stream_options(req), echo_texts=echo_texts, want_logprobs=want_logprobs
        )
        return await stream_response(request, state, generation, chunks, record)
    finals = await collect(request, state, generation, record)
    if finals is None:
        return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")
    body = protocol.completion_response(
        ctx, finals, echo_texts=echo_texts, want_logprobs=want_logprobs
    )
    return json_response(body)


@generation_handler
async def create_chat_completion(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.serving_engine()
    req = protocol.ChatCompletionRequest.parse(await read_json(request, body_limit(engine)))
    check_model(req.model, engine)
    params = req.to_sampling_params(engine.default_sampling)
    admit(engine, 1, params.n)
    # From here to the engine's admission there is no await: the admission check holds.
    add_generation_prompt = req.add_generation_prompt is not False
    messages = req.template_messages()
    ids = render_chat(engine.tokenizer, messages, add_generation_prompt)
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
    record.start(ctx, ["\n".join(str(m["content"]) for m in messages)])
    want_logprobs = bool(req.logprobs)
    if req.stream:
        chunks = protocol.ChatChunks(ctx, _stream_options(req), want_logprobs=want_logprobs)
        return await stream_response(request, state, generation, chunks, record)
    finals = await collect(request, state, generation, record)
    if finals is None:
        return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")
    return json_response(protocol.chat_response(ctx, finals[0], want_logprobs=want_logprobs))


class Generation:
    """The engine requests of one HTTP request (one per prompt) and their merged outputs.

    Whoever iterates it must call `abort_unfinished(reason)` when done (a finally block): that
    is the HTTP side of the one abort path, and a no-op once every request finished."""

    def __init__(
        self, engine: AsyncEngine, streams: list[RequestStream], timers: list[RequestTimer]
    ) -> None:
        self.engine = engine
        self.streams = streams
        self.timers = timers

    def deltas(self, idle: float = 0.0) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
        """(prompt index, delta) as they arrive, and None whenever `idle` seconds pass without
        one (0: never). Raises what the engine failed a request with (EngineDeadError,
        QueueTimeoutError)."""
        timeout = idle if idle > 0 else None
        return self._single(timeout) if len(self.streams) == 1 else self._merged(timeout)

    async def _single(
        self, timeout: float | None
    ) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
        stream, timer = self.streams[0], self.timers[0]
        while True:
            output = await stream.get_within(timeout)
            if output is None:
                yield None
                continue
            timer.observe(output)
            yield 0, output
            if output.finished:
                return

    async def _merged(
        self, timeout: float | None
    ) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
        pending = {asyncio.ensure_future(s.get()): i for i, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(
                    pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    yield None
                    continue
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
            async for item in deltas:
                if item is not None:
                    accumulators[item[0]].add(item[1])
        return [a.result() for a in accumulators]

    def abort_unfinished(self, reason: str) -> None:
        for stream in self.streams:
            if not stream.taken_final:
                self.engine.abort(stream.request_id, reason)


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
            engine.abort(stream.request_id, "rejected")
        if isinstance(exc, EngineDeadError):
            raise ServiceUnavailableError(f"The engine failed: {exc}") from None
        if isinstance(exc, ValueError):
            raise BadRequestError(str(exc), param=_engine_param(str(exc), what)) from None
        raise
    timers = [state.metrics.timer(engine.model_name) for _ in streams]
    return Generation(engine, streams, timers)


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
    except (EngineDeadError, QueueTimeoutError) as exc:
        raise generation_error(exc) from None
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
    chunks: protocol.CompletionChunks | protocol.ChatChunks,
    record: RequestRecord,
) -> web.StreamResponse:
    """Stream the chunks as SSE, with keep-alive comments while nothing moves. A failure
    before the first write is a plain HTTP error; after it, an error event and [DONE]."""
    config = state.config
    events = EventStream(request, config.stream_write_timeout)

    async def pump() -> None:
        opened = False
        deltas = generation.deltas(idle=config.sse_keep_alive_interval)
        async with contextlib.aclosing(deltas) as items:
            async for item in items:
                if item is None:
                    await events.send_keep_alive()
                    continue
                index, output = item
                payloads = [] if opened else chunks.opening()
                opened = True
                payloads.extend(chunks.delta(index, output))
                for seq in output.outputs:
                    record.add(index, seq)
                await events.send(payloads)
        await events.send(chunks.closing())
        await events.send_done()

    reason = "cancelled"
    try:
        await state.watcher.guard(request, pump())
    except ClientDisconnected as exc:
        reason = exc.reason
        logger.info("client left (%s); aborted %s", reason, generation.streams[0].request_id)
        if not events.started:
            return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")
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
            await events.send([error_body(error.status, error.message)])
            await events.send_done()
    finally:
        generation.abort_unfinished(reason)
    await events.finish()
    return events.response


def generation_error(exc: BaseException) -> APIError | None:
    """The HTTP error for what the engine failed a request with; None for anything else."""
    if isinstance(exc, EngineDeadError):
        return InternalServerError(f"The engine failed while generating: {exc}")
    if isinstance(exc, QueueTimeoutError):
        return ServiceUnavailableError(str(exc), headers={"Retry-After": RETRY_AFTER})
    return None


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
    if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadRequestError(
            f"The body is nested too deeply: more than {MAX_JSON_DEPTH} levels of arrays and "
            "objects"
        )
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"The body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        kind = "an array" if isinstance(data, list) else f"a {type(data).__name__}"
        raise BadRequestError(f"The body must be a JSON object, got {kind}")
    return data


def json_depth(body: bytes, at_least: int = 0) -> int:
    """How deeply arrays and objects nest in a JSON text, without parsing it (and so without
    recursion); brackets inside strings do not count. Bodies with at most `at_least` brackets
    in all are answered with a cheap upper bound: their count."""
    num_brackets = sum(body.count(c) for c in (b"[", b"{"))
    if num_brackets <= at_least:
        return num_brackets
    skeleton = _JSON_STRING.sub(b"", body).translate(_BRACKETS, _NOT_BRACKETS)
    return max(itertools.accumulate(array.array("b", skeleton)), default=0)


def _too_large(size: int, limit: int) -> str:
    return f"Request body too large: {size} bytes, the limit is {limit} bytes"


def check_model(name: str | None, engine: AsyncEngine) -> None:
    if name and name != engine.model_name:
        raise NotFoundError(
            f"The model `{name}` does not exist. Valid models: {engine.model_name}.",
            param="model",
        )


def count_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """How many prompts a (validated) completions prompt holds, without tokenizing it."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def admit(engine: AsyncEngine, num_prompts: int, n: int) -> None:
    """Admission control, run after parsing and before any tokenization work: 400 for a
    request that can never be admitted, a fast 503 with Retry-After while the queue is full."""
    total = num_prompts * n
    if total > MAX_SEQUENCES_PER_REQUEST:
        raise BadRequestError(
            f"A request may ask for at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts x n), "
            f"got {num_prompts} x {n}",
            param="n" if num_prompts == 1 else "prompt",
        )
    try:
        engine.check_admission(total)
    except EngineOverloadedError as exc:
        raise ServiceUnavailableError(str(exc), headers={"Retry-After": RETRY_AFTER}) from None
    except EngineDeadError as exc:
        raise ServiceUnavailableError(f"The engine failed: {exc}") from None
    except ValueError as exc:
        raise BadRequestError(str(exc), param="n") from None


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


_ENGINE_PARAMS = (
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "stop_token_ids",
    "min_tokens",
    "n",
)


def _engine_param(message: str, default: str) -> str:
    """The field an engine ValueError is about (its messages name the field)."""
    first = message.split(" ", 1)[0]
    if first == "logprobs" and default == "messages":
        return "top_logprobs"  # chat asks for alternatives with top_logprobs
    if first in _ENGINE_PARAMS:
        return first
    if "max_tokens" in message or "you requested" in message:
        return "max_tokens"
    return default
