"""GET /v1/models and /v1/models/{model}: the served model, its aliases and its LoRA adapters,
as OpenAI's model cards."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from aioinfer.server.http.bodies import check_model, json_response
from aioinfer.server.http.state import STATE, ServerState
from aioinfer.server.openai.shapes import ModelCard

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


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
    """The served model's card, or a LoRA adapter's (its parent: the served model). An
    adapter's root is its name: vLLM shows its folder, a path on the server that no client
    needs."""
    card = model_card(name, engine.max_model_len, state.created)
    if name in engine.loras.slots:
        card["parent"] = engine.model_name
    return card


def model_card(name: str, max_model_len: int, created: int) -> ModelCard:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "aioinfer",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {"id": f"modelperm-{name}", "object": "model_permission", "allow_sampling": True}
        ],
    }
