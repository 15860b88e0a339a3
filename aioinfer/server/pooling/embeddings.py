"""POST /v1/embeddings, served by a pooling model (--runner pooling): each input's vector, as
OpenAI's embeddings (floats, or base64 of float32 bytes)."""

from __future__ import annotations

import time

from aiohttp import web

from aioinfer.server.http.bodies import json_response, parse_request
from aioinfer.server.http.errors import BadRequestError
from aioinfer.server.http.request_log import RequestRecord, generation_handler
from aioinfer.server.http.sse import client_closed
from aioinfer.server.pooling.embed_inputs import embed_inputs
from aioinfer.server.pooling.embeddings_protocol import EmbeddingRequest, embedding_response


@generation_handler
async def create_embedding(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, EmbeddingRequest)
    if engine.pooler is not None and engine.pooler.classifies:
        raise BadRequestError(
            f"The model {engine.model_name!r} is a classifier: it serves /classify, /score and "
            "/rerank, not embeddings",
            param="model",
        )
    params = req.to_pooling_params()
    outputs = await embed_inputs(
        request, record, engine, req.input, params, "embd", "input", req.priority,
        add_special_tokens=req.add_special_tokens,
    )  # fmt: skip
    if outputs is None:
        return client_closed()
    body = embedding_response(
        record.request_id,
        int(time.time()),
        engine.model_name,
        [o.outputs.data for o in outputs],
        record.prompt_tokens,
        req.encoding_format,
    )
    return json_response(body)
