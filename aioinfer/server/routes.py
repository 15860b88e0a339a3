"""The route table: the one place that wires every API's handlers to their paths; and the two
routes that span APIs: /invocations (SageMaker's, which picks an API by the body's fields) and
/openapi.json (the document of them all)."""

from __future__ import annotations

import functools

import orjson
from aiohttp import web

from aioinfer import __version__
from aioinfer.server.anthropic.api import count_message_tokens, create_message
from aioinfer.server.http.bodies import body_limit, read_json
from aioinfer.server.http.errors import BadRequestError
from aioinfer.server.http.state import STATE
from aioinfer.server.http.status import (
    health,
    is_sleeping,
    load,
    metrics,
    ping,
    server_info,
    version,
)
from aioinfer.server.openai.completions import create_chat_completion, create_completion
from aioinfer.server.openai.lora import (
    load_lora_adapter,
    runtime_lora_updating,
    unload_lora_adapter,
)
from aioinfer.server.openai.models import list_models, retrieve_model
from aioinfer.server.openai.tokenize import detokenize, tokenize
from aioinfer.server.openapi import openapi_document
from aioinfer.server.pooling.classify import create_classification
from aioinfer.server.pooling.embeddings import create_embedding
from aioinfer.server.pooling.scores import create_rerank, create_score
from aioinfer.server.responses.api import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)


def setup_routes(app: web.Application) -> None:
    router = app.router
    router.add_get("/health", health)
    router.add_route("*", "/ping", ping)
    router.add_get("/load", load)
    router.add_post("/invocations", invocations)
    router.add_get("/version", version)
    router.add_get("/is_sleeping", is_sleeping)
    for path in ("/server_info", "/get_server_info"):
        router.add_get(path, server_info)
    router.add_get("/metrics", metrics)
    router.add_get("/openapi.json", openapi)
    router.add_get("/v1/models", list_models)
    router.add_get("/v1/models/{model}", retrieve_model)
    router.add_post("/v1/completions", create_completion)
    router.add_post("/v1/chat/completions", create_chat_completion)
    router.add_post("/v1/embeddings", create_embedding)
    for path in ("/classify", "/v1/classify"):
        router.add_post(path, create_classification)
    for path in ("/score", "/v1/score"):
        router.add_post(path, create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_post(path, create_rerank)
    router.add_post("/v1/responses", create_response)
    router.add_get("/v1/responses/{response_id}", retrieve_response)
    router.add_delete("/v1/responses/{response_id}", delete_response)
    router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    router.add_post("/v1/messages", create_message)
    router.add_post("/v1/messages/count_tokens", count_message_tokens)
    if runtime_lora_updating():
        router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    router.add_post("/tokenize", tokenize)
    router.add_post("/detokenize", detokenize)


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's one inference route, as vLLM's: the body's fields pick the API (messages:
    chat, prompt: completions, input: embeddings)."""
    data = await read_json(request, body_limit(request.app[STATE].serving_engine()))
    for field, handler in (
        ("messages", create_chat_completion),
        ("prompt", create_completion),
        ("input", create_embedding),
    ):
        if field in data:
            return await handler(request)
    raise BadRequestError(
        "/invocations takes a chat completion (messages), a completion (prompt) or an "
        "embedding (input) request"
    )


@functools.cache
def _openapi_json() -> bytes:
    """The document, built on first use (its schemas take a moment) and kept."""
    return orjson.dumps(openapi_document(__version__))


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=_openapi_json(), content_type="application/json")
