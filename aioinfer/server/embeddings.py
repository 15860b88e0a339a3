"""POST /v1/embeddings, served by a pooling model (--runner pooling): each input is prefilled
and pooled, never decoded. All inputs are admitted or none; leaving early aborts them all."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from aioinfer.engine.stream import EngineDeadError, RequestAbortedError, RequestStream
from aioinfer.server.bodies import json_response, parse_request
from aioinfer.server.completions import REQUEST_ID_HEADER, generation_handler
from aioinfer.server.embeddings_protocol import EmbeddingRequest, embedding_response
from aioinfer.server.errors import BadRequestError, ServiceUnavailableError
from aioinfer.server.generation import admit, generation_error
from aioinfer.server.prompts import count_prompts, encode_prompts, num_chars, off_loop_if_long
from aioinfer.server.request_log import RequestRecord
from aioinfer.server.state import STATE

if TYPE_CHECKING:
    from aioinfer.core.outputs import EmbeddingRequestOutput
    from aioinfer.engine.async_engine import AsyncEngine


@generation_handler
async def create_embedding(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, EmbeddingRequest)
    if engine.pooler is None:
        raise BadRequestError(
            f"The model {engine.model_name!r} generates text: it does not serve embeddings "
            "(start the server with --runner pooling)",
            param="model",
        )
    params = req.to_pooling_params()
    num_inputs = count_prompts(req.input)
    _admit(engine, num_inputs)
    prompts = await off_loop_if_long(
        num_chars(req.input), encode_prompts, engine.tokenizer, req.input, req.add_special_tokens
    )
    _admit(engine, num_inputs)  # again: the queue may have filled meanwhile
    client_id = request.headers.get(REQUEST_ID_HEADER)
    unique = uuid.uuid4().hex
    response_id = f"embd-{client_id or unique}"
    engine_id = f"{response_id}-{unique[:8]}" if client_id else response_id
    streams: list[RequestStream] = []
    try:
        for index, prompt in enumerate(prompts):
            request_id = engine_id if len(prompts) == 1 else f"{engine_id}-{index}"
            streams.append(
                engine.add_pooling_request(
                    prompt.token_ids, params, request_id, prompt.text, priority=req.priority
                )
            )
    except BaseException as exc:
        for stream in streams:
            engine.abort(stream.request_id, "rejected")
        if isinstance(exc, EngineDeadError):
            raise ServiceUnavailableError(f"The engine failed: {exc}") from None
        if isinstance(exc, ValueError):
            raise BadRequestError(str(exc), param=_param_of(str(exc))) from None
        raise
    record.request_id = response_id
    record.prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
    metrics = request.app[STATE].metrics

    async def embed(stream: RequestStream) -> EmbeddingRequestOutput:
        timer = metrics.timer(engine.model_name)
        output = await engine.embedding_of(stream, params)
        timer.finished()
        return output

    try:
        outputs = await asyncio.gather(*(embed(s) for s in streams))
    except BaseException as exc:
        for stream in streams:  # the others, when one failed
            engine.abort(stream.request_id)
        if isinstance(exc, RequestAbortedError):
            raise ServiceUnavailableError(f"The request was aborted: {exc}") from None
        error = generation_error(exc)
        if error is not None:
            raise error from None
        raise
    record.finish_reasons = ["stop"] * len(outputs)
    body = embedding_response(
        response_id,
        int(time.time()),
        engine.model_name,
        [o.outputs.data for o in outputs],
        record.prompt_tokens,
        req.encoding_format,
    )
    return json_response(body)


def _admit(engine: AsyncEngine, num_inputs: int) -> None:
    """Admission control as for generation; a 400 names `input`, the field that counts here."""
    try:
        admit(engine, num_inputs, 1)
    except BadRequestError as exc:
        exc.param = "input"
        raise


def _param_of(message: str) -> str:
    for name in ("dimensions", "priority"):
        if message.startswith(name):
            return name
    return "input"
