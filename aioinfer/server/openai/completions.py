"""POST /v1/completions and /v1/chat/completions: parse, admit, hand the prompts to the engine,
and answer with one JSON body or with SSE chunks.

Everything that can be refused is refused before the engine sees the request (a 400 names the
field); once the request is admitted, leaving the output iteration for any reason (client gone,
handler cancelled, engine failure) aborts it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.http.bodies import json_response, parse_request
from aioinfer.server.http.errors import APIError, InternalServerError, error_body
from aioinfer.server.http.request_log import RequestRecord
from aioinfer.server.http.sse import ClientDisconnected, EventStream, encode_event
from aioinfer.server.http.state import STATE, ServerState
from aioinfer.server.openai.render import (
    ChatChunks,
    CompletionChunks,
    Prompt,
    ResponseContext,
    StreamOptionsView,
    chat_response,
    completion_response,
)
from aioinfer.server.serving.generation import (
    Generation,
    admit,
    generation_error,
    prepare_constraints,
    start_generation,
    truncate_prompts,
)
from aioinfer.server.serving.prompts import (
    count_prompts,
    encode_prompts,
    num_chars,
    off_loop_if_long,
    render_chat_off_loop,
)
from aioinfer.server.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
)
from aioinfer.server.serving.reasoning import continued_text, make_reasoning_parser
from aioinfer.server.serving.tool_parsers import ToolParser, make_tool_parser
from aioinfer.server.serving.tools import AUTO_NEEDS_PARSER

if TYPE_CHECKING:
    from aioinfer.config import ServerConfig
    from aioinfer.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
# A client's own id for a request: it names the response and comes back as a header.
REQUEST_ID_HEADER = "X-Request-Id"


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id for a response id, or None where it is not UTF-8 text (its
    bytes would then fail the response's JSON after the whole generation ran)."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


BodyBuilder = Callable[[list[RequestOutput]], Mapping[str, Any]]


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
        finally:
            state.in_flight -= 1
            if config.log_requests:
                record.log()

    return wrapper


@generation_handler
async def create_completion(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine, req = await parse_request(request, CompletionRequest)
    params = req.to_sampling_params(engine.default_sampling)
    admit(engine, count_prompts(req.prompt), params.n)
    constraints = await prepare_constraints(engine, params, req.structured_param)
    prompts = await off_loop_if_long(
        num_chars(req.prompt), encode_prompts, engine.tokenizer, req.prompt, req.add_special_tokens
    )
    prompts = truncate_prompts(engine, prompts, params)
    # Again: the queue may have filled while a long prompt was tokenized. From here to the
    # engine's admission there is no await, so the check holds.
    admit(engine, count_prompts(req.prompt), params.n)
    ctx = _response_context("cmpl", request, engine, prompts, req, params.n)
    want_logprobs = req.logprobs is not None
    generation = start_generation(
        engine,
        ctx,
        params,
        clamp_max_tokens=not req.max_tokens_given,
        prompt_only=req.prompt_only,
        constraints=constraints,
        priority=req.priority,
    )
    echo_texts = None
    if req.echo:  # after admission, which checked the prompts' token ids
        decode = engine.tokenizer.decode
        echo_texts = [ctx.prompt_text(i, decode) for i in range(len(prompts))]
    record.start(ctx, [p.text for p in prompts])
    chunks: CompletionChunks | None = None
    if req.stream:
        chunks = CompletionChunks(
            ctx,
            _stream_options(req, state.config),
            echo_texts=echo_texts,
            want_logprobs=want_logprobs,
        )

    def body(finals: list[RequestOutput]) -> Mapping[str, Any]:
        return completion_response(ctx, finals, echo_texts=echo_texts, want_logprobs=want_logprobs)

    return await answer(request, state, generation, record, chunks, body)


@generation_handler
async def create_chat_completion(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine, req = await parse_request(request, ChatCompletionRequest)
    chat = await start_chat(request, engine, req, record)
    ctx, tool_parser = chat.ctx, chat.tool_parser
    want_logprobs = bool(req.logprobs)
    tool_mode = req.tool_mode
    chunks: ChatChunks | None = None
    if req.stream:
        chunks = ChatChunks(
            ctx,
            _stream_options(req, state.config),
            want_logprobs=want_logprobs,
            tool_mode=tool_mode,
            tool_parser=tool_parser,
        )

    def body(finals: list[RequestOutput]) -> Mapping[str, Any]:
        return chat_response(
            ctx,
            finals[0],
            want_logprobs=want_logprobs,
            tool_mode=tool_mode,
            tool_parser=tool_parser,
        )

    return await answer(request, state, chat.generation, record, chunks, body)


@dataclass
class ChatStart:
    """A chat request handed to the engine: what its answer is built from."""

    ctx: ResponseContext
    generation: Generation
    tool_parser: ToolParser | None  # tool_choice "auto": reads calls from the text


async def start_chat(
    request: web.Request,
    engine: AsyncEngine,
    req: ChatCompletionRequest,
    record: RequestRecord,
    response_id: str | None = None,
) -> ChatStart:
    """Admit a chat request and start its generation: its messages rendered through the chat
    template, its tools and format as constraints. `response_id`: the id of the response (by
    default chatcmpl-<hex>)."""
    state = request.app[STATE]
    tool_parser = None
    if req.auto_tools:
        parallel = req.parallel_tool_calls is not False
        tool_parser = make_tool_parser(state.config.tool_call_parser, parallel=parallel)
    if req.auto_tools and tool_parser is None:
        raise RequestValidationError(AUTO_NEEDS_PARSER, "tool_choice")
    params = req.to_sampling_params(engine.default_sampling)
    admit(engine, 1, params.n)
    constraints = await prepare_constraints(engine, params, req.structured_param)
    messages = req.template_messages()
    options = req.template_options()
    ids = await render_chat_off_loop(engine.tokenizer, messages, options, state.config)
    admit(engine, 1, params.n)  # again, as for completions; no await from here on
    prompts = truncate_prompts(engine, [Prompt(ids)], params)
    ctx = _response_context("chatcmpl", request, engine, prompts, req, params.n, response_id)
    reasoning_parser = make_reasoning_parser(state.config.reasoning_parser)
    if reasoning_parser is not None:
        continued = continued_text(messages) if options["continue_final_message"] else None
        ctx.reasoning = reasoning_parser.split(
            prompts[0].token_ids,
            engine.tokenizer,
            include=req.include_reasoning is not False,
            continued=continued,
        )
        if constraints is not None:
            constraints = ctx.reasoning.gate(constraints)
    generation = start_generation(
        engine,
        ctx,
        params,
        clamp_max_tokens=not req.max_tokens_given,
        what="messages",
        constraints=constraints,
        priority=req.priority,
    )
    record.start(ctx, ["\n".join(str(m["content"]) for m in messages)])
    return ChatStart(ctx, generation, tool_parser)


def _response_context(
    prefix: str,
    request: web.Request,
    engine: AsyncEngine,
    prompts: list[Prompt],
    req: CompletionRequest | ChatCompletionRequest,
    n: int,
    response_id: str | None = None,
) -> ResponseContext:
    """The response id (`prefix`-<hex> as OpenAI's, or `prefix`-<the client's X-Request-Id, else
    the body's request_id> as vLLM's; `response_id` where given) and what all its responses
    share. Engine ids stay unique whatever clients send."""
    unique = uuid.uuid4().hex
    client_id = None if response_id is not None else client_request_id(request) or req.request_id
    if response_id is None:
        response_id = f"{prefix}-{client_id or unique}"
    # A name other than the served model's is an adapter (check_model said so): never the
    # base model, even if the adapter is unloaded meanwhile (start_generation answers 404).
    lora = req.model if req.model and req.model != engine.model_name else None
    return ResponseContext(
        response_id,
        lora or engine.model_name,
        prompts,
        n,
        request.app[STATE].token_text(engine.tokenizer),
        token_bytes=request.app[STATE].token_bytes(engine.tokenizer),
        engine_id=f"{response_id}-{unique[:8]}" if client_id else response_id,
        return_token_ids=bool(req.return_token_ids),
        prompt_logprobs=req.prompt_logprobs,
        echo_logprobs=(req.logprobs or 0) if isinstance(req, CompletionRequest) else 0,
        cached_tokens={} if request.app[STATE].config.enable_prompt_tokens_details else None,
        lora=lora,
        cache_salt=req.cache_salt,
    )


def _stream_options(
    req: CompletionRequest | ChatCompletionRequest, config: ServerConfig
) -> StreamOptionsView:
    return StreamOptionsView(
        req.include_usage or config.enable_force_include_usage, req.continuous_usage
    )


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
        return _client_closed()
    return json_response(body(finals))


def _client_closed() -> web.Response:
    return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")


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
        if framing.done:
            await events.send_done()

    reason = "cancelled"
    try:
        await state.watcher.guard(request, pump())
    except ClientDisconnected as exc:
        reason = exc.reason
        logger.info("client left (%s); aborted %s", reason, generation.streams[0].request_id)
        if not events.started:
            return _client_closed()
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
