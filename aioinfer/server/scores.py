"""POST /score and /rerank (with their /v1 and /v2 aliases) over an embedding model: every
distinct text is embedded once, in one batch, and a pair scores the cosine similarity of its
two embeddings, as vLLM scores with embedding models."""

from __future__ import annotations

import time

from aiohttp import web

from aioinfer.core.pooling import PoolingParams, cosine
from aioinfer.server.bodies import json_response, parse_request
from aioinfer.server.completions import generation_handler
from aioinfer.server.embeddings import client_closed, embed_inputs
from aioinfer.server.protocol import RequestValidationError
from aioinfer.server.request_log import RequestRecord
from aioinfer.server.scores_protocol import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    ranked,
)


@generation_handler
async def create_score(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, ScoreRequest)
    pairs = req.pairs()
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    params = _params(req.truncate_prompt_tokens)
    outputs = await embed_inputs(
        request, record, engine, texts, params, "score", "text_2", req.priority
    )
    if outputs is None:
        return client_closed()
    vectors = {text: output.outputs.data for text, output in zip(texts, outputs, strict=True)}
    body: ScoreResponse = {
        "id": record.request_id,
        "object": "list",
        "created": int(time.time()),
        "model": engine.model_name,
        "data": [
            {"index": index, "object": "score", "score": cosine(vectors[a], vectors[b])}
            for index, (a, b) in enumerate(pairs)
        ],
        "usage": {"prompt_tokens": record.prompt_tokens, "total_tokens": record.prompt_tokens},
    }
    return json_response(body)


@generation_handler
async def create_rerank(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, RerankRequest)
    texts = list(dict.fromkeys([req.query, *req.documents]))
    params = _params(req.truncate_prompt_tokens)
    outputs = await embed_inputs(
        request, record, engine, texts, params, "rerank", "documents", req.priority
    )
    if outputs is None:
        return client_closed()
    vectors = {text: output.outputs.data for text, output in zip(texts, outputs, strict=True)}
    query = vectors[req.query]
    scores = [cosine(query, vectors[document]) for document in req.documents]
    body: RerankResponse = {
        "id": record.request_id,
        "model": engine.model_name,
        "usage": {"total_tokens": record.prompt_tokens},
        "results": ranked(req.documents, scores, req.top_n, req.return_documents),
    }
    return json_response(body)


def _params(truncate_prompt_tokens: int | None) -> PoolingParams:
    try:
        return PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
    except ValueError as exc:
        raise RequestValidationError(str(exc), "truncate_prompt_tokens") from None
