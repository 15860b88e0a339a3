"""POST /v1/responses, and GET and DELETE /v1/responses/{response_id}: OpenAI's Responses API
over the chat machinery.

The request becomes a chat request (`ResponsesRequest.to_chat`) that starts like any other
(`start_chat`: admission, constraints, the chat template); the answer is a response object, or
named SSE events without [DONE]. Errors name the Responses fields. A stored response (`store`,
the default) can be read back and continued with `previous_response_id`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.bodies import json_response, parse_request
from aioinfer.server.completions import Framing, answer, generation_handler, start_chat
from aioinfer.server.errors import NotFoundError
from aioinfer.server.request_log import RequestRecord
from aioinfer.server.responses_protocol import (
    INPUT_ITEMS,
    InputItem,
    ResponsesRequest,
    responses_params,
)
from aioinfer.server.responses_render import (
    ResponseDeleted,
    ResponseEvents,
    ResponseObject,
    new_id,
)
from aioinfer.server.responses_store import ResponseStore, StoredResponse
from aioinfer.server.sse import encode_named_event
from aioinfer.server.state import STATE


@generation_handler
async def create_response(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine, req = await parse_request(request, ResponsesRequest)
    history = _history(state.responses, req.previous_response_id)
    chat = req.to_chat(history)
    with responses_params():
        started = await start_chat(request, engine, chat, record, response_id=new_id("resp"))
    conversation = (*history, *req.input)

    def store(response: ResponseObject) -> None:
        if req.store is not False:
            output: list[InputItem] = INPUT_ITEMS.validate_python(response["output"])
            state.responses.put(StoredResponse(response, (*conversation, *output)))

    events = ResponseEvents(
        started.ctx,
        req.echo(),
        tool_mode=chat.tool_mode,
        tool_parser=started.tool_parser,
        want_logprobs=req.want_logprobs,
        on_done=store,
    )

    def body(finals: list[RequestOutput]) -> Mapping[str, Any]:
        return events.complete(finals[0])

    framing = Framing(encode_named_event, done=False, error=events.error)
    chunks = events if req.stream else None
    return await answer(request, state, started.generation, record, chunks, body, framing)


def _history(store: ResponseStore, previous_id: str | None) -> list[InputItem]:
    """The conversation that `previous_response_id` continues; 404 for one not stored."""
    if previous_id is None:
        return []
    previous = store.get(previous_id)
    if previous is None:
        raise NotFoundError(
            f"Previous response with id '{previous_id}' not found.", param="previous_response_id"
        )
    return list(previous.conversation)


async def retrieve_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = request.app[STATE].responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.body)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[STATE].responses.delete(response_id):
        raise _not_found(response_id)
    deleted: ResponseDeleted = {"id": response_id, "object": "response", "deleted": True}
    return json_response(deleted)


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
