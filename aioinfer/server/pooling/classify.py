"""POST /classify (vLLM's), served by a *ForSequenceClassification model: each input's class
probabilities and the label of the likeliest class."""

from __future__ import annotations

import time

from aiohttp import web

from aioinfer.server.http.bodies import json_response, parse_request
from aioinfer.server.http.errors import BadRequestError
from aioinfer.server.http.request_log import RequestRecord, generation_handler
from aioinfer.server.http.sse import client_closed
from aioinfer.server.pooling.classify_protocol import ClassifyRequest, classify_response
from aioinfer.server.pooling.embed_inputs import embed_inputs
from aioinfer.server.pooling.embeddings_protocol import pooling_params


@generation_handler
async def create_classification(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, ClassifyRequest)
    pooler = engine.pooler
    if pooler is None or not pooler.classifies:
        raise BadRequestError(
            f"The model {engine.model_name!r} is not a classifier: /classify needs a "
            "*ForSequenceClassification model",
            param="model",
        )
    params = pooling_params(None, None, req.truncate_prompt_tokens)
    outputs = await embed_inputs(
        request, record, engine, req.input, params, "classify", "input", req.priority,
        add_special_tokens=req.add_special_tokens,
    )  # fmt: skip
    if outputs is None:
        return client_closed()
    body = classify_response(
        record.request_id,
        int(time.time()),
        engine.model_name,
        [o.outputs.data for o in outputs],
        pooler.labels,
        record.prompt_tokens,
    )
    return json_response(body)
