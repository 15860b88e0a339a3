"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat
machinery.

The request becomes a chat request (`MessagesRequest.to_chat`) that starts like any other
(`start_chat`: admission, constraints, the chat template); the answer is a message, or named SSE
events without [DONE]. Errors name the Messages fields and come in Anthropic's envelope (the
error middleware picks it by path, see `http.errors`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.anthropic.protocol import (
    MessagesRequest,
    MessageTokensCountRequest,
    messages_params,
)
from aioinfer.server.anthropic.render import MessageEvents, MessageTokensCount
from aioinfer.server.http.bodies import BODY_SIZE, json_response, parse_request
from aioinfer.server.http.request_log import RequestRecord, generation_handler
from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.http.sse import encode_named_event
from aioinfer.server.http.state import STATE
from aioinfer.server.serving.answer import Framing, answer
from aioinfer.server.serving.chat import start_chat
from aioinfer.server.serving.context import new_id
from aioinfer.server.serving.prompts import off_loop_if_long, render_chat_off_loop
from aioinfer.server.serving.tool_parsers import make_tool_parser
from aioinfer.server.serving.tools import AUTO_NEEDS_PARSER_START

AUTO_NEEDS_PARSER = AUTO_NEEDS_PARSER_START + (
    'or send tool_choice {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}'
)


@generation_handler
async def create_message(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine, req = await parse_request(request, MessagesRequest)
    chat = await off_loop_if_long(request, request[BODY_SIZE], req.to_chat)
    if chat.auto_tools and make_tool_parser(state.config.tool_call_parser) is None:
        raise RequestValidationError(AUTO_NEEDS_PARSER, "tool_choice")
    with messages_params():
        started = await start_chat(request, engine, chat, record, response_id=new_id("msg"))
    events = MessageEvents(started.ctx, tool_mode=chat.tool_mode, tool_parser=started.tool_parser)

    def body(finals: list[RequestOutput]) -> Mapping[str, Any]:
        return events.complete(finals[0])

    framing = Framing(encode_named_event, done=False, error=events.error)
    chunks = events if req.stream else None
    return await answer(request, state, started.generation, record, chunks, body, framing)


async def count_message_tokens(request: web.Request) -> web.Response:
    """The prompt's length in tokens, as the chat template renders the request; nothing is
    generated."""
    engine, req = await parse_request(request, MessageTokensCountRequest)
    chat = await off_loop_if_long(request, request[BODY_SIZE], req.to_chat)
    with messages_params():
        rendered = await render_chat_off_loop(
            request, engine.tokenizer, chat.messages, chat, engine.max_model_len, request[BODY_SIZE]
        )
    count: MessageTokensCount = {"input_tokens": len(rendered.token_ids)}
    return json_response(count)
