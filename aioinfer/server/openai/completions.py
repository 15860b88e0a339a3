"""POST /v1/completions and /v1/chat/completions: parse, admit, hand the prompts to the engine,
and answer with one JSON body or with SSE chunks.

Everything that can be refused is refused before the engine sees the request (a 400 names the
field); once the request is admitted, leaving the output iteration for any reason (client gone,
handler cancelled, engine failure) aborts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.http.bodies import parse_request
from aioinfer.server.http.request_log import RequestRecord, generation_handler
from aioinfer.server.http.state import STATE
from aioinfer.server.openai.protocol import CompletionRequest
from aioinfer.server.openai.render import (
    ChatChunks,
    CompletionChunks,
    StreamOptionsView,
    chat_response,
    completion_response,
)
from aioinfer.server.serving.answer import answer
from aioinfer.server.serving.chat import response_context, start_chat
from aioinfer.server.serving.generation import (
    admit,
    check_prompt_logprobs,
    prepare_constraints,
    start_generation,
    truncate_prompts,
)
from aioinfer.server.serving.prompts import (
    count_prompts,
    encode_prompts,
    num_chars,
    off_loop_if_long,
)
from aioinfer.server.serving.protocol import ChatCompletionRequest, GenerationRequest

if TYPE_CHECKING:
    from aioinfer.config import ServerConfig


@generation_handler
async def create_completion(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine, req = await parse_request(request, CompletionRequest)
    params = req.to_sampling_params(engine.default_sampling)
    admit(engine, count_prompts(req.prompt), params.n)
    constraints = await prepare_constraints(request, engine, params, req.structured_param)
    prompts = await off_loop_if_long(
        request,
        num_chars(req.prompt),
        encode_prompts,
        engine.tokenizer,
        req.prompt,
        req.add_special_tokens,
    )
    prompts = truncate_prompts(engine, prompts, params)
    echo_logprobs = req.logprobs if req.echo else None
    check_prompt_logprobs(prompts, params.n, req.prompt_logprobs, echo_logprobs)
    # Again: the queue may have filled while a long prompt was tokenized, and now the prompts'
    # tokens count. From here to the engine's admission there is no await, so the check holds.
    num_tokens = sum(len(p.token_ids) for p in prompts)
    admit(engine, count_prompts(req.prompt), params.n, num_tokens=num_tokens)
    ctx = response_context(
        "cmpl", request, engine, prompts, req, params.n, echo_logprobs=req.logprobs or 0
    )
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


def _stream_options(req: GenerationRequest, config: ServerConfig) -> StreamOptionsView:
    return StreamOptionsView(
        req.include_usage or config.enable_force_include_usage, req.continuous_usage
    )
