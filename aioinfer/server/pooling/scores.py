"""POST /score and /rerank (with their /v1 and /v2 aliases) over a pooling model, as vLLM scores:
- a cross-encoder (a classifier of one label) reads each pair as one prompt, joined the way its
  tokenizer joins a text pair, and scores the probability it gives;
- an embedding model embeds every distinct text once, in one batch, and a pair scores the
  cosine similarity of its two embeddings. Usage counts each pair's texts, as a model that
  reads pairs would."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from aioinfer.core.pooling import cosine
from aioinfer.server.http.bodies import json_response, parse_request
from aioinfer.server.http.errors import BadRequestError
from aioinfer.server.http.request_log import RequestRecord, generation_handler
from aioinfer.server.http.sse import client_closed
from aioinfer.server.pooling.embed_inputs import embed_inputs
from aioinfer.server.pooling.embeddings_protocol import pooling_params
from aioinfer.server.pooling.scores_protocol import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    ranked,
)
from aioinfer.server.serving.prompts import off_loop_if_long

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


@generation_handler
async def create_score(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, ScoreRequest)
    pairs = req.pairs()
    scored = await _score_pairs(request, record, engine, pairs, req, "score", ("text_1", "text_2"))
    if scored is None:
        return client_closed()
    scores, tokens = scored
    body: ScoreResponse = {
        "id": record.request_id,
        "object": "list",
        "created": int(time.time()),
        "model": engine.model_name,
        "data": [
            {"index": index, "object": "score", "score": score}
            for index, score in enumerate(scores)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json_response(body)


@generation_handler
async def create_rerank(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    engine, req = await parse_request(request, RerankRequest)
    documents = req.texts()
    pairs = [(req.query, d) for d in documents]
    scored = await _score_pairs(
        request, record, engine, pairs, req, "rerank", ("query", "documents")
    )
    if scored is None:
        return client_closed()
    scores, tokens = scored
    body: RerankResponse = {
        "id": record.request_id,
        "model": engine.model_name,
        "usage": {"total_tokens": tokens},
        "results": ranked(documents, scores, req.top_n, req.return_documents),
    }
    return json_response(body)


async def _score_pairs(
    request: web.Request,
    record: RequestRecord,
    engine: AsyncEngine,
    pairs: list[tuple[str, str]],
    req: ScoreRequest | RerankRequest,
    prefix: str,
    names: tuple[str, str],
) -> tuple[list[float], int] | None:
    """Each pair's score and the tokens read (None when the client left first); a 400 names
    the field a failing text came from (`names`: the first's and the second's)."""
    pooler = engine.pooler
    if pooler is not None and pooler.classifies:
        return await _cross_encode(request, record, engine, pairs, req, prefix, names)
    named = [(a, names[0]) for a, _ in pairs] + [(b, names[1]) for _, b in pairs]
    embedded = await _embed(request, record, engine, named, req, prefix, names[1])
    if embedded is None:
        return None
    vectors, lengths = embedded
    scores = [cosine(vectors[a], vectors[b]) for a, b in pairs]
    return scores, sum(lengths[a] + lengths[b] for a, b in pairs)


async def _cross_encode(
    request: web.Request,
    record: RequestRecord,
    engine: AsyncEngine,
    pairs: list[tuple[str, str]],
    req: ScoreRequest | RerankRequest,
    prefix: str,
    names: tuple[str, str],
) -> tuple[list[float], int] | None:
    """A one-label classifier's probability for each pair read as one prompt; a pair too long
    for the model is blamed on its longer text's field."""
    from aioinfer.engine.tokenizer import encode_pairs

    assert engine.pooler is not None
    try:
        engine.pooler.check_cross_encoder()
    except ValueError as exc:
        raise BadRequestError(f"{engine.model_name!r}: {exc}", param="model") from None
    keep = req.truncate_prompt_tokens
    pooling_params(None, None, keep)  # a 400 naming the field for a bad value
    firsts, seconds = [a for a, _ in pairs], [b for _, b in pairs]
    chars = sum(len(a) + len(b) for a, b in pairs)
    prompts = await off_loop_if_long(
        request, chars, encode_pairs, engine.tokenizer, firsts, seconds, keep, engine.max_model_len
    )
    fields = [names[0] if len(a) > len(b) else names[1] for a, b in pairs]
    outputs = await embed_inputs(
        request, record, engine, prompts, pooling_params(None, None, None), prefix, names[1],
        req.priority, fields=fields,
    )  # fmt: skip
    if outputs is None:
        return None
    return [float(o.outputs.data[0]) for o in outputs], record.prompt_tokens


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
