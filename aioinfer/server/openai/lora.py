"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA endpoints,
served only when AIOINFER_ALLOW_RUNTIME_LORA_UPDATING is set. A lora_path must lie under
--lora-root (symlinks resolved; without the flag every path is refused), and a path that fails
gets one message whatever the reason, so that no client learns which files the server has."""

from __future__ import annotations

import logging
import os
from typing import Any

from aiohttp import web

from aioinfer.core.lora import LoRARequest
from aioinfer.server.http.bodies import MiB, read_json
from aioinfer.server.http.errors import BadRequestError, NotFoundError
from aioinfer.server.http.state import STATE
from aioinfer.server.http.validation import logged

logger = logging.getLogger(__name__)

# vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (read too, as charts set it): any client may then
# load adapters from the server's paths under --lora-root.
RUNTIME_LORA_ENV = "AIOINFER_ALLOW_RUNTIME_LORA_UPDATING"
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """Whether the load/unload endpoints are served (ours, else vLLM's variable)."""
    value = os.environ.get(RUNTIME_LORA_ENV)
    if value is None:
        value = os.environ.get(VLLM_RUNTIME_LORA_ENV, "")
    return value.lower() in ("1", "true")


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's: {"lora_name", "lora_path"} loads an adapter that requests may then name; the
    path is taken under --lora-root."""
    state = request.app[STATE]
    engine = state.serving_engine()
    name, path = _lora_fields(await read_json(request, MiB), "lora_name", "lora_path")
    if name in engine.loras.paths or name == engine.model_name:
        raise BadRequestError(
            f"The lora adapter '{name}' has already been loaded.", param="lora_name"
        )
    # What is known without reading any file is said as it is.
    model_config = engine.model_config
    if not model_config.enable_lora:
        raise BadRequestError("LoRA adapters need --enable-lora", param="lora_path")
    if len(engine.loras.slots) >= model_config.max_loras:
        raise BadRequestError(
            f"cannot load LoRA adapter {name!r}: all {model_config.max_loras} slots are taken "
            "(--max-loras)",
            param="lora_path",
        )
    folder = _under_root(path, state.config.lora_root, name)
    try:
        await engine.add_lora(LoRARequest(name, len(engine.loras.slots) + 1, folder))
    except ValueError as exc:
        logger.warning(
            "Runtime LoRA adapter %s not loaded from %s: %s",
            logged(name), logged(folder), logged(str(exc))[1:-1],
        )  # fmt: skip
        raise _refused(name) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


def _under_root(path: str, root: str | None, name: str) -> str:
    """`path` (relative ones from the root) with its symlinks resolved, when that lies under
    the root; otherwise the same refusal as for a folder that is no adapter."""
    if root is None:
        raise BadRequestError(
            "This server loads no adapter from a path at run time: it was started without "
            "--lora-root",
            param="lora_path",
        )
    base = os.path.realpath(root)
    try:
        folder = os.path.realpath(os.path.join(base, path))
        inside = os.path.commonpath([base, folder]) == base
    except ValueError:  # a NUL byte; a path on another drive
        inside = False
    if not inside:
        logger.warning(
            "Runtime LoRA adapter %s refused: %s is not under --lora-root",
            logged(name), logged(path),
        )  # fmt: skip
        raise _refused(name)
    return folder


def _refused(name: str) -> BadRequestError:
    return BadRequestError(
        f"LoRA adapter {name!r} could not be loaded: lora_path must name a PEFT LoRA folder "
        "under the server's --lora-root that this model can take (the server's log says why)",
        param="lora_path",
    )


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
