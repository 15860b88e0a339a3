"""How a request is fitted to the model before it is queued, the same for the HTTP API and the
offline LLM: its prompt truncated (`truncate_prompt_tokens`), its max_tokens (and min_tokens
with it) lowered to what the context leaves where that is allowed, and the sequences of several
prompts queued all or none."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.model_limits import ModelLimits

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine
    from aioinfer.engine.stream import RequestStream


def shape(
    limits: ModelLimits, prompt_ids: list[int], params: SamplingParams, *, clamp_max_tokens: bool
) -> tuple[list[int], SamplingParams]:
    """The prompt as the model will see it, and params whose max_tokens fits the context after
    it: lowered to the room left where `clamp_max_tokens` allows it (vLLM's offline engine
    always; the API only for a max_tokens the client did not give), min_tokens with it. A
    max_tokens left too large is the engine's ValueError, which names both numbers."""
    ids = limits.truncate(prompt_ids, params)
    room = limits.max_model_len - len(ids)
    if clamp_max_tokens and params.max_tokens is not None and 1 <= room < params.max_tokens:
        params = params.clone(max_tokens=room, min_tokens=min(params.min_tokens, room))
    return ids, params


def queue_all(
    engine: AsyncEngine, count: int, add: Callable[[int], RequestStream]
) -> list[RequestStream]:
    """`add(i)` for each of a request's `count` prompts, all or none: when one is refused (or
    anything else fails), those queued before it are aborted and the error goes on."""
    streams: list[RequestStream] = []
    try:
        for index in range(count):
            streams.append(add(index))
    except BaseException:
        for stream in streams:
            engine.abort(stream.request_id, "rejected")
        raise
    return streams
