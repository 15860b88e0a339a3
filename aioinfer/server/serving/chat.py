"""A request's start: its ResponseContext (the response id and what all its responses share),
and for a chat, whatever API it came from, `start_chat`: admission, constraints, the chat
template and the engine requests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from aioinfer.server.http.auth import cache_salt_of
from aioinfer.server.http.bodies import BODY_SIZE
from aioinfer.server.http.request_id import client_request_id
from aioinfer.server.http.request_log import RequestRecord
from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.http.state import STATE
from aioinfer.server.serving.context import Prompt, ResponseContext
from aioinfer.server.serving.generation import (
    Generation,
    admit,
    check_prompt_logprobs,
    prepare_constraints,
    start_generation,
    truncate_prompts,
)
from aioinfer.server.serving.prompts import render_chat_off_loop
from aioinfer.server.serving.protocol import ChatCompletionRequest, GenerationRequest
from aioinfer.server.serving.reasoning import continued_text, make_reasoning_parser
from aioinfer.server.serving.tool_parsers import ToolParser, make_tool_parser
from aioinfer.server.serving.tools import AUTO_NEEDS_PARSER

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


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
    body_size: int | None = None,
) -> ChatStart:
    """Admit a chat request and start its generation: its messages rendered through the chat
    template, its tools and format as constraints. `response_id`: the id of the response (by
    default chatcmpl-<hex>); `body_size`: the bytes of what the chat was made from (by default
    the body's), which decide whether it renders off the event loop."""
    state = request.app[STATE]
    tool_parser = None
    if req.auto_tools:
        parallel = req.parallel_tool_calls is not False
        tool_parser = make_tool_parser(state.config.tool_call_parser, parallel=parallel)
    if req.auto_tools and tool_parser is None:
        raise RequestValidationError(AUTO_NEEDS_PARSER, "tool_choice")
    params = req.to_sampling_params(engine.default_sampling)
    admit(engine, 1, params.n)
    constraints = await prepare_constraints(request, engine, params, req.structured_param)
    size = request[BODY_SIZE] if body_size is None else body_size
    rendered = await render_chat_off_loop(
        request, engine.tokenizer, req.messages, req, engine.max_model_len, size
    )
    messages, options = rendered.messages, rendered.options
    prompts = truncate_prompts(engine, [Prompt(rendered.token_ids)], params)
    check_prompt_logprobs(prompts, params.n, req.prompt_logprobs)
    # Again, as for completions, with the prompt's tokens; no await from here on.
    admit(engine, 1, params.n, num_tokens=len(prompts[0].token_ids), tokens_field="messages")
    ctx = response_context("chatcmpl", request, engine, prompts, req, params.n, response_id)
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


def response_context(
    prefix: str,
    request: web.Request,
    engine: AsyncEngine,
    prompts: list[Prompt],
    req: GenerationRequest,
    n: int,
    response_id: str | None = None,
    *,
    echo_logprobs: int = 0,
) -> ResponseContext:
    """The response id (`prefix`-<hex> as OpenAI's, or `prefix`-<the client's X-Request-Id, else
    the body's request_id> as vLLM's; `response_id` where given) and what all its responses
    share. Engine ids stay unique whatever clients send. `echo_logprobs`: see ResponseContext
    (completions only)."""
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
        echo_logprobs=echo_logprobs,
        cached_tokens={} if request.app[STATE].config.enable_prompt_tokens_details else None,
        lora=lora,
        cache_salt=cache_salt_of(request, req.cache_salt),
    )
