"""The pooling of a request's inputs, shared by /v1/embeddings, /classify, /score and /rerank:
each input is prefilled and pooled, never decoded. All inputs are admitted or none; a client
that leaves, or one input that fails, aborts them all."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from aioinfer.engine.stream import (
    EngineDeadError,
    RequestAbortedError,
    RequestStream,
    gather_or_cancel,
)
from aioinfer.server.http.auth import cache_salt_of
from aioinfer.server.http.errors import (
    BadRequestError,
    InternalServerError,
    ServiceUnavailableError,
)
from aioinfer.server.http.request_id import client_request_id
from aioinfer.server.http.request_log import RequestRecord
from aioinfer.server.http.sse import ClientDisconnected
from aioinfer.server.http.state import STATE
from aioinfer.server.serving.generation import admit, generation_error, queue_all
from aioinfer.server.serving.prompts import (
    count_prompts,
    encode_prompts,
    num_chars,
    off_loop_if_long,
)

if TYPE_CHECKING:
    from aioinfer.core.outputs import EmbeddingRequestOutput
    from aioinfer.core.pooling import PoolingParams
    from aioinfer.engine.async_engine import AsyncEngine
    from aioinfer.server.http.state import ServerState

logger = logging.getLogger(__name__)

# Engine messages that start with one of these are about that field; the rest about the inputs.
_PARAMS = ("dimensions", "priority", "truncate_prompt_tokens")


async def embed_inputs(
    request: web.Request,
    record: RequestRecord,
    engine: AsyncEngine,
    inputs: str | list[str] | list[int] | list[list[int]],
    params: PoolingParams,
    prefix: str,
    field: str,
    priority: int = 0,
    add_special_tokens: bool = True,
    fields: Sequence[str] | None = None,
) -> list[EmbeddingRequestOutput] | None:
    """The embeddings of a request's inputs, in order (None when the client left first). A 400
    names `field` (or input i's `fields[i]`) for what cannot be embedded; `record` gets the
    response id (`prefix`-...) and the token count."""
    if engine.pooler is None:
        raise BadRequestError(
            f"The model {engine.model_name!r} generates text: it does not serve embeddings "
            "(--runner pooling makes embeddings from it)",
            param="model",
        )
    num_inputs = count_prompts(inputs)
    admit(engine, num_inputs, 1, field=field)
    prompts = await off_loop_if_long(
        request, num_chars(inputs), encode_prompts, engine.tokenizer, inputs, add_special_tokens
    )
    # Again: the queue may have filled meanwhile, and now the inputs' tokens count.
    admit(engine, num_inputs, 1, field=field, num_tokens=sum(len(p.token_ids) for p in prompts))
    client_id = client_request_id(request)
    unique = uuid.uuid4().hex
    response_id = f"{prefix}-{client_id or unique}"
    engine_id = f"{response_id}-{unique[:8]}" if client_id else response_id

    def add(index: int) -> RequestStream:
        prompt = prompts[index]
        request_id = engine_id if len(prompts) == 1 else f"{engine_id}-{index}"
        return engine.add_pooling_request(
            prompt.token_ids,
            params,
            request_id,
            prompt.text,
            priority,
            group=engine_id if len(prompts) > 1 else None,
            cache_salt=cache_salt_of(request, None),
        )

    def param_of(message: str, index: int) -> str:
        first = message.split(" ", 1)[0]
        if first in _PARAMS:
            return first
        return fields[index] if fields is not None else field

    streams = queue_all(engine, len(prompts), add, param_of)
    record.request_id = response_id
    record.prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
    outputs = await _embeddings(request, request.app[STATE], engine, streams, params)
    if outputs is not None:
        record.finish_reasons = ["stop"] * len(outputs)
    return outputs


async def _embeddings(
    request: web.Request,
    state: ServerState,
    engine: AsyncEngine,
    streams: list[RequestStream],
    params: PoolingParams,
) -> list[EmbeddingRequestOutput] | None:
    """Every input's embedding, in order; None when the client left first. Whatever ends the
    wait early aborts the inputs not done yet."""
    reason = "cancelled"
    try:
        embeddings = (engine.embedding_of(s, params) for s in streams)
        return await state.watcher.guard(request, gather_or_cancel(embeddings))
    except ClientDisconnected as exc:
        reason = exc.reason
        logger.info("client left; aborted %s", streams[0].request_id)
        return None
    except RequestAbortedError as exc:
        raise ServiceUnavailableError(f"The request was aborted: {exc}") from None
    except EngineDeadError as exc:
        raise InternalServerError(f"The engine failed: {exc}") from None
    except Exception as exc:
        error = generation_error(exc)  # a queue timeout: 503 with Retry-After
        if error is None:
            raise
        raise error from None
    finally:
        for stream in streams:
            if not stream.taken_final:
                engine.abort(stream.request_id, reason)
