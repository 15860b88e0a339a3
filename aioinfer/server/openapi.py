"""The OpenAPI 3.1 document of the server (/openapi.json), built from the request models and
the response shapes.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import TypeAdapter

from aioinfer.server.anthropic.protocol import MessagesRequest, MessageTokensCountRequest
from aioinfer.server.anthropic.render import MessageObject, MessageStreamEvent, MessageTokensCount
from aioinfer.server.http.errors import AnthropicErrorResponse, ErrorResponse
from aioinfer.server.http.status import ServerLoad, VersionResponse
from aioinfer.server.openai.protocol import CompletionRequest
from aioinfer.server.openai.shapes import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from aioinfer.server.openai.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from aioinfer.server.pooling.classify_protocol import ClassifyRequest, ClassifyResponse
from aioinfer.server.pooling.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from aioinfer.server.pooling.scores_protocol import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from aioinfer.server.responses.protocol import OUTPUT_LOGPROBS, ResponsesRequest
from aioinfer.server.responses.render import ResponseDeleted, ResponseObject, ResponseStreamEvent
from aioinfer.server.responses.store import InputItemList
from aioinfer.server.serving.protocol import ChatCompletionRequest

_JSON = "application/json"
_ERROR_CODES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "503": "Engine not ready, shutting down, or queue full (with Retry-After)",
}
_OPEN: dict[str, Any] = {"security": []}  # routes that need no API key
# The Messages API's routes take the key as Anthropic's clients send it, or as a bearer token.
_ANTHROPIC_KEYS: dict[str, Any] = {"security": [{"bearer": []}, {"x-api-key": []}]}
# Only where a body is read, or the engine generates.
_BODY_ERROR_CODES = {"413": "Body over the size limit"}
_GENERATION_ERROR_CODES = {"500": "The engine failed while generating"}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


_RETRIEVE_QUERY = [
    _query("stream", {"type": "boolean", "default": False}),
    _query("starting_after", {"type": "integer", "minimum": -1}),
]
_INPUT_ITEMS_QUERY = [
    _query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}),
    _query("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}),
    _query("after", {"type": "string"}),
    _query("before", {"type": "string"}),
    _query("include", {"type": "array", "items": {"type": "string", "enum": [OUTPUT_LOGPROBS]}}),
]


def openapi_document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server, built from the request models and the response
    shapes."""
    components: dict[str, Any] = {}

    def ref(kind: Any, mode: Literal["validation", "serialization"]) -> dict[str, Any]:
        schema = TypeAdapter(kind).json_schema(
            mode=mode, ref_template="#/components/schemas/{model}"
        )
        components.update(schema.pop("$defs", {}))
        name = getattr(kind, "__name__", str(kind))
        components[name] = schema
        return {"$ref": f"#/components/schemas/{name}"}

    def body(kind: Any) -> dict[str, Any]:
        return {"required": True, "content": {_JSON: {"schema": ref(kind, "validation")}}}

    def events(chunk: Any, error_shape: Any) -> dict[str, Any]:
        """Each SSE event (OpenAPI 3.1: the schema describes one event): its data is a chunk,
        an in-band error, or the final [DONE]."""
        json_data = {
            "contentMediaType": _JSON,
            "contentSchema": {
                "anyOf": [ref(chunk, "serialization"), ref(error_shape, "serialization")]
            },
        }
        data = {"type": "string", "if": {"const": "[DONE]"}, "else": json_data}
        return {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}

    def ok(
        kind: Any | None,
        media: str = _JSON,
        stream: Any = None,
        error_shape: Any = ErrorResponse,
    ) -> dict[str, Any]:
        """Responses of an operation; `stream` is the chunk type when it can stream;
        `error_shape` the body of its errors."""
        responses: dict[str, Any] = {"200": {"description": "OK"}}
        if kind is not None:
            content = {media: {"schema": ref(kind, "serialization")}}
            if stream is not None:
                content["text/event-stream"] = events(stream, error_shape)
            responses["200"]["content"] = content
        codes = dict(_ERROR_CODES)
        if stream is not None:
            codes.update(_GENERATION_ERROR_CODES)
        error = {_JSON: {"schema": ref(error_shape, "serialization")}}
        for code, text in codes.items():
            responses[code] = {"description": text, "content": error}
        return responses

    def op(
        summary: str,
        responses: dict[str, Any],
        request: Any = None,
        parameters: list[dict[str, Any]] | None = None,
        error_shape: Any = ErrorResponse,
    ) -> dict[str, Any]:
        operation: dict[str, Any] = {"summary": summary, "responses": responses}
        if request is not None:
            operation["requestBody"] = body(request)
            error = {_JSON: {"schema": ref(error_shape, "serialization")}}
            for code, text in _BODY_ERROR_CODES.items():
                responses[code] = {"description": text, "content": error}
        if parameters:
            operation["parameters"] = parameters
        return operation

    text_plain = {"200": {"description": "OK", "content": {"text/plain": {"schema": {}}}}}
    too_many_background = {
        "429": {
            "description": "Too many background responses of this API key (with Retry-After)",
            "content": {_JSON: {"schema": ref(ErrorResponse, "serialization")}},
        }
    }
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    response_param = {**model_param, "name": "response_id"}
    paths = {
        "/v1/models": {"get": op("List the served model", ok(ModelList))},
        "/v1/models/{model}": {
            "get": op("The served model, by its name", ok(ModelCard), parameters=[model_param])
        },
        "/v1/completions": {
            "post": op(
                "Text completion",
                ok(CompletionResponse, stream=CompletionChunk),
                CompletionRequest,
            )
        },
        "/v1/chat/completions": {
            "post": op(
                "Chat completion",
                ok(ChatCompletionResponse, stream=ChatCompletionChunk),
                ChatCompletionRequest,
            )
        },
        "/v1/responses": {
            "post": op(
                "Create a response (the Responses API; streamed as named events, no [DONE])",
                ok(ResponseObject, stream=ResponseStreamEvent) | too_many_background,
                ResponsesRequest,
            )
        },
        "/v1/responses/{response_id}": {
            "get": op(
                "A stored response (stream=true: a streamed background response's events)",
                ok(ResponseObject, stream=ResponseStreamEvent),
                parameters=[response_param, *_RETRIEVE_QUERY],
            ),
            "delete": op(
                "Forget a stored response", ok(ResponseDeleted), parameters=[response_param]
            ),
        },
        "/v1/responses/{response_id}/cancel": {
            "post": op(
                "Stop a background response", ok(ResponseObject), parameters=[response_param]
            ),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": op(
                "The items a stored response was generated from, a page at a time",
                ok(InputItemList),
                parameters=[response_param, *_INPUT_ITEMS_QUERY],
            ),
        },
        "/v1/messages": {
            "post": op(
                "Create a message (Anthropic's Messages API; streamed as named events)",
                ok(MessageObject, stream=MessageStreamEvent, error_shape=AnthropicErrorResponse),
                MessagesRequest,
                error_shape=AnthropicErrorResponse,
            )
            | _ANTHROPIC_KEYS
        },
        "/v1/messages/count_tokens": {
            "post": op(
                "The prompt tokens of a Messages request, as the chat template renders it",
                ok(MessageTokensCount, error_shape=AnthropicErrorResponse),
                MessageTokensCountRequest,
                error_shape=AnthropicErrorResponse,
            )
            | _ANTHROPIC_KEYS
        },
        "/v1/embeddings": {
            "post": op(
                "Create embeddings (a pooling model: --runner pooling)",
                ok(EmbeddingResponse),
                EmbeddingRequest,
            )
        },
        **{
            path: {
                "post": op(
                    "Class probabilities (a *ForSequenceClassification model)",
                    ok(ClassifyResponse),
                    ClassifyRequest,
                )
            }
            for path in ("/classify", "/v1/classify")
        },
        **{
            path: {
                "post": op(
                    "Text pairs' scores: a cross-encoder's probability, or the cosine "
                    "similarity of their embeddings (a pooling model)",
                    ok(ScoreResponse),
                    ScoreRequest,
                )
            }
            for path in ("/score", "/v1/score")
        },
        **{
            path: {
                "post": op(
                    "Documents by their score against the query (as /score)",
                    ok(RerankResponse),
                    RerankRequest,
                )
            }
            for path in ("/rerank", "/v1/rerank", "/v2/rerank")
        },
        "/tokenize": {"post": op("Tokenize", ok(TokenizeResponse), TokenizeRequest)},
        "/detokenize": {"post": op("Detokenize", ok(DetokenizeResponse), DetokenizeRequest)},
        # Open to load balancers and scrapers: no API key needed.
        "/health": {"get": op("200 once the engine serves, 503 otherwise", ok(None)) | _OPEN},
        "/ping": {
            method: op("As /health (SageMaker's health check)", ok(None)) | _OPEN
            for method in ("get", "post")
        },
        "/load": {"get": op("Requests being answered now", ok(ServerLoad)) | _OPEN},
        "/version": {"get": op("Server version", ok(VersionResponse)) | _OPEN},
        "/metrics": {"get": op("Prometheus metrics", text_plain) | _OPEN},
        "/openapi.json": {
            "get": op(
                "This document",
                {"200": {"description": "OK", "content": {_JSON: {"schema": {"type": "object"}}}}},
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "aioinfer", "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}],
    }
