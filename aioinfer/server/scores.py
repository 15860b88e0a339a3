"""POST /score and /rerank (with their /v1 and /v2 aliases) over an embedding model: every
distinct text is embedded once, in one batch, and a pair scores the cosine similarity of its
two embeddings, as vLLM scores with embedding models. Usage counts each pair's texts, as a
model that reads pairs would."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from aioinfer.core.pooling import cosine
from aioinfer.server.bodies import json_response, parse_request
from aioinfer.server.completions import generation_handler
from aioinfer.server.embeddings import client_closed, embed_inputs
from aioinfer.server.embeddings_protocol import pooling_params
from aioinfer.server.request_log import RequestRecord
from aioinfer.server.scores_protocol import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    ranked,
)

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


@generation_handler
async def create_score(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, ScoreRequest)
    pairs = req.pairs()
    named = [(a, "text_1") for a, _ in pairs] + [(b, "text_2") for _, b in pairs]
    embedded = await _embed(request, record, engine, named, req, "score", "text_2")
    if embedded is None:
        return client_closed()
    vectors, lengths = embedded
    tokens = sum(lengths[a] + lengths[b] for a, b in pairs)
    body: ScoreResponse = {
        "id": record.request_id,
        "object": "list",
        "created": int(time.time()),
        "model": engine.model_name,
        "data": [
            {"index": index, "object": "score", "score": cosine(vectors[a], vectors[b])}
            for index, (a, b) in enumerate(pairs)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json_response(body)


@generation_handler
async def create_rerank(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, RerankRequest)
    documents = req.texts()
    named = [(req.query, "query")] + [(d, "documents") for d in documents]
    embedded = await _embed(request, record, engine, named, req, "rerank", "documents")
    if embedded is None:
        return client_closed()
    vectors, lengths = embedded
    scores = [cosine(vectors[req.query], vectors[d]) for d in documents]
    body: RerankResponse = {
        "id": record.request_id,
        "model": engine.model_name,
        "usage": {"total_tokens": sum(lengths[req.query] + lengths[d] for d in documents)},
        "results": ranked(documents, scores, req.top_n, req.return_documents),
    }
    return json_response(body)


async def _embed(
    request: web.Request,
    record: RequestRecord,
    engine: AsyncEngine,
    named: list[tuple[str, str]],
    req: ScoreRequest | RerankRequest,
    prefix: str,
    field: str,
) -> tuple[dict[str, np.ndarray], dict[str, int]] | None:
    """Each distinct text's embedding and token count (None when the client left first). A
    400 about one text names the field it first came from; one about them all (too many)
    names `field`."""
    fields: dict[str, str] = {}
    for text, field in named:
        fields.setdefault(text, field)
    texts = list(fields)
    params = pooling_params(None, None, req.truncate_prompt_tokens)
    outputs = await embed_inputs(
        request, record, engine, texts, params, prefix, field, req.priority,
        fields=[fields[text] for text in texts],
    )  # fmt: skip
    if outputs is None:
        return None
    vectors = {text: output.outputs.data for text, output in zip(texts, outputs, strict=True)}
    lengths = {
        text: len(output.prompt_token_ids) for text, output in zip(texts, outputs, strict=True)
    }
    return vectors, lengths
