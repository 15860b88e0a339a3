"""POST /v1/responses, and GET and DELETE /v1/responses/{response_id}: OpenAI's Responses API
over the chat machinery.

The request becomes a chat request (`ResponsesRequest.to_chat`) that starts like any other
(`start_chat`: admission, constraints, the chat template); the answer is a response object, or
named SSE events without [DONE]. Errors name the Responses fields. A stored response (`store`,
the default) can be read back and continued with `previous_response_id`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.bodies import BODY_SIZE, json_response, parse_request
from aioinfer.server.completions import Framing, answer, generation_handler, start_chat
from aioinfer.server.errors import NotFoundError
from aioinfer.server.prompts import off_loop_if_long
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
from aioinfer.server.responses_store import ResponseStore, StoredResponse, owner_of
from aioinfer.server.sse import encode_named_event
from aioinfer.server.state import STATE

logger = logging.getLogger(__name__)


@generation_handler
async def create_response(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    state = request.app[STATE]
    engine, req = await parse_request(request, ResponsesRequest)
    owner = _owner(request)
    previous = _previous(state.responses, req.previous_response_id, owner)
    history = list(previous.conversation) if previous is not None else []
    previous_size = previous.size if previous is not None else 0
    chat = await off_loop_if_long(request[BODY_SIZE] + previous_size, req.to_chat, history)
    with responses_params():
        started = await start_chat(request, engine, chat, record, response_id=new_id("resp"))
    conversation = (*history, *req.input)
    # What storing it keeps alive: this request, the conversation before it, and the output.
    kept_bytes = request[BODY_SIZE] + previous_size

    def store(response: ResponseObject) -> None:
        if req.store is False:
            return
        output: list[InputItem] = INPUT_ITEMS.validate_python(response["output"])
        size = kept_bytes + len(orjson.dumps(response))
        stored = StoredResponse(response, (*conversation, *output), owner, size)
        if not state.responses.put(stored):
            logger.warning("response %s not stored: %d bytes", response["id"], size)

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


def _owner(request: web.Request) -> bytes | None:
    """The API key a request came with, as stored responses are scoped (None without keys:
    the auth middleware let the request in, so a server with keys always sees one)."""
    if not request.app[STATE].config.api_key:
        return None
    _, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    return owner_of(token.strip())


def _previous(
    store: ResponseStore, previous_id: str | None, owner: bytes | None
) -> StoredResponse | None:
    """The response that `previous_response_id` continues; 404 for one not stored."""
    if previous_id is None:
        return None
    previous = store.get(previous_id, owner)
    if previous is None:
        raise NotFoundError(
            f"Previous response with id '{previous_id}' not found.", param="previous_response_id"
        )
    return previous


async def retrieve_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = request.app[STATE].responses.get(response_id, _owner(request))
    if stored is None:
        raise _not_found(response_id)
    return json_response(stored.body)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[STATE].responses.delete(response_id, _owner(request)):
        raise _not_found(response_id)
    deleted: ResponseDeleted = {"id": response_id, "object": "response", "deleted": True}
    return json_response(deleted)


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
