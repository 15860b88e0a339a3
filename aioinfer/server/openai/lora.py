"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA endpoints,
served only when AIOINFER_ALLOW_RUNTIME_LORA_UPDATING is set (any client may then load
adapters from the server's paths)."""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

from aioinfer.core.lora import LoRARequest
from aioinfer.server.http.bodies import MiB, read_json
from aioinfer.server.http.errors import BadRequestError, NotFoundError
from aioinfer.server.http.state import STATE

# vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (read too, as charts set it): any client may then
# load adapters from server paths.
RUNTIME_LORA_ENV = "AIOINFER_ALLOW_RUNTIME_LORA_UPDATING"
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """Whether the load/unload endpoints are served (ours, else vLLM's variable)."""
    value = os.environ.get(RUNTIME_LORA_ENV)
    if value is None:
        value = os.environ.get(VLLM_RUNTIME_LORA_ENV, "")
    return value.lower() in ("1", "true")


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
