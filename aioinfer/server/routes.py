"""The route table, and the small endpoints: health, version, metrics, the OpenAPI document,
models, tokenize and detokenize. Generation lives in `completions`, `responses_api` and
`messages_api`; embeddings in `embeddings`."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aioinfer import __version__
from aioinfer.core.lora import LoRARequest
from aioinfer.server.anthropic.api import count_message_tokens, create_message
from aioinfer.server.http.bodies import (
    MiB,
    body_limit,
    check_model,
    json_response,
    parse_request,
    read_json,
)
from aioinfer.server.http.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from aioinfer.server.http.state import STATE, ServerState
from aioinfer.server.openai.completions import create_chat_completion, create_completion
from aioinfer.server.openai.render import model_card
from aioinfer.server.openai.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from aioinfer.server.pooling.embeddings import create_classification, create_embedding
from aioinfer.server.pooling.scores import create_rerank, create_score
from aioinfer.server.responses.api import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from aioinfer.server.serving.prompts import off_loop_if_long, render_chat_off_loop
from aioinfer.server.serving.shapes import ModelCard, TokenizeResponse

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


def setup_routes(app: web.Application) -> None:
    router = app.router
    router.add_get("/health", health)
    router.add_route("*", "/ping", ping)
    router.add_get("/load", load)
    router.add_post("/invocations", invocations)
    router.add_get("/version", version)
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
    if os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"):
        router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    router.add_post("/tokenize", tokenize)
    router.add_post("/detokenize", detokenize)


async def health(request: web.Request) -> web.Response:
    reason = request.app[STATE].unavailable_reason()
    if reason is not None:
        raise ServiceUnavailableError(reason)
    return web.Response(status=200)


async def ping(request: web.Request) -> web.Response:
    """SageMaker's health check (GET or POST), as vLLM serves it: /health's answer."""
    if request.method not in ("GET", "POST"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
    return await health(request)


async def load(request: web.Request) -> web.Response:
    """The requests being answered now, as vLLM's /load (for a router's balancing)."""
    return json_response({"server_load": request.app[STATE].in_flight})


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
    names = [engine.model_name, *engine.model_aliases, *engine.loras.slots]
    cards = [_model_card(state, engine, name) for name in names]
    return json_response({"object": "list", "data": cards})


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.serving_engine()
    name = request.match_info["model"]
    check_model(name, engine)
    return json_response(_model_card(state, engine, name))


def _model_card(state: ServerState, engine: AsyncEngine, name: str) -> ModelCard:
    """The served model's card, or a LoRA adapter's (its parent: the served model)."""
    card = model_card(name, engine.max_model_len, state.created)
    if name in engine.loras.slots:
        card["root"] = engine.loras.paths.get(name, name)
        card["parent"] = engine.model_name
    return card


# vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: any client may then load adapters from server paths.
RUNTIME_LORA_ENV = "AIOINFER_ALLOW_RUNTIME_LORA_UPDATING"


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's: {"lora_name", "lora_path"} loads an adapter that requests may then name."""
    engine = request.app[STATE].serving_engine()
    name, path = _lora_fields(await read_json(request, MiB), "lora_name", "lora_path")
    if name in engine.loras.paths or name == engine.model_name:
        raise BadRequestError(
            f"The lora adapter '{name}' has already been loaded.", param="lora_name"
        )
    try:
        await engine.add_lora(LoRARequest(name, len(engine.loras.slots) + 1, path))
    except ValueError as exc:
        raise BadRequestError(str(exc), param="lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's: {"lora_name"} unloads an adapter no unfinished request uses."""
    engine = request.app[STATE].serving_engine()
    (name,) = _lora_fields(await read_json(request, MiB), "lora_name")
    if name not in engine.loras.slots:
        raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    try:
        await engine.remove_lora(name)
    except ValueError as exc:
        raise BadRequestError(str(exc), param="lora_name") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _lora_fields(body: dict[str, Any], *names: str) -> list[str]:
    values = [body.get(name) for name in names]
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, str) or not value:
            raise BadRequestError(f"{name} must be a non-empty string", param=name)
    return values  # type: ignore[return-value]


async def tokenize(request: web.Request) -> web.Response:
    engine, req = await parse_request(request, TokenizeRequest)
    if req.messages is not None:
        messages = [m.to_template() for m in req.messages]
        config = request.app[STATE].config
        ids = await render_chat_off_loop(engine.tokenizer, messages, req.template_options(), config)
    else:
        special = req.add_special_tokens is not False
        text = req.prompt or ""
        tokenize_text = functools.partial(engine.tokenizer, add_special_tokens=special)
        encoded = await off_loop_if_long(len(text), tokenize_text, text)
        ids = list(encoded["input_ids"])
    body: TokenizeResponse = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": engine.max_model_len,
    }
    if req.return_token_strs:
        body["token_strs"] = list(engine.tokenizer.convert_ids_to_tokens(ids))
    return json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    engine, req = await parse_request(request, DetokenizeRequest)
    vocab = int(engine.info.vocab_size)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequestError(f"tokens must be in [0, {vocab}), got {bad[0]}", param="tokens")
    return json_response({"prompt": engine.tokenizer.decode(req.tokens)})
