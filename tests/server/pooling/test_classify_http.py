"""POST /classify, and /score and /rerank over a cross-encoder, with the fake runner: its fake
`score` head keeps the first labels' values of the last token's hidden state as the logits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from aioinfer.config import ServerConfig
from aioinfer.core.pooling import PoolerConfig, class_probabilities
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from tests.server.conftest import assert_pool_free, build_engine, text_prompt_ids
from tests.server.pooling.test_embeddings_http import response_json
from tests.server.test_http import error_of, post
from tests.support.fake_runner import reference_pooled
from tests.support.tokenizers import make_tokenizer

LABELS = ("negative", "neutral", "positive")


def logits(prompt: list[int], num_labels: int) -> np.ndarray:
    return reference_pooled(prompt, "LAST")[:num_labels]


async def classifier_client(
    aiohttp_client: Callable[..., Any], labels: tuple[str, ...]
) -> AsyncIterator[tuple[Any, AsyncEngine]]:
    # A budget of 8 tokens: most inputs are pooled over several chunks.
    pooler = PoolerConfig("LAST", normalize=False, labels=labels)
    engine = await build_engine(pooler=pooler, max_num_batched_tokens=8)
    try:
        yield await aiohttp_client(create_app(engine, ServerConfig())), engine
    finally:
        await engine.shutdown()


@pytest.fixture
async def classifier(aiohttp_client):
    async for pair in classifier_client(aiohttp_client, LABELS):
        yield pair


@pytest.fixture
async def cross_encoder(aiohttp_client):
    async for pair in classifier_client(aiohttp_client, ("relevant",)):
        yield pair


async def test_classify_gives_each_inputs_probabilities_and_label(classifier):
    client, engine = classifier
    texts = ["The quick brown fox", "jumps over the lazy dog, again and again"]
    for path in ("/classify", "/v1/classify"):
        response, raw = await post(client, path, {"input": texts})
        assert response.status == 200, raw
        body = response_json(raw)
        assert body["object"] == "list" and body["id"].startswith("classify-")
        for index, (data, text) in enumerate(zip(body["data"], texts, strict=True)):
            expected = class_probabilities(logits(text_prompt_ids(text), 3))
            assert data["index"] == index and data["num_classes"] == 3
            np.testing.assert_allclose(data["probs"], expected, rtol=1e-5)
            assert sum(data["probs"]) == pytest.approx(1.0)
            assert data["label"] == LABELS[int(np.argmax(expected))]
        tokens = sum(len(text_prompt_ids(t)) for t in texts)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    assert_pool_free(engine)


async def test_classify_takes_token_ids_and_names_bad_fields(classifier):
    client, engine = classifier
    _, raw = await post(client, "/classify", {"input": [5, 6, 7]})
    assert response_json(raw)["data"][0]["probs"] == pytest.approx(
        class_probabilities(logits([5, 6, 7], 3)).tolist()
    )
    for body, param in (
        ({"input": []}, "input"),
        ({"input": [[5] * 129]}, "input"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ):
        _, raw = await post(client, "/classify", body)
        assert error_of(raw, 400)["param"] == param
    assert_pool_free(engine)


async def test_a_classifier_serves_no_embeddings_and_no_text(classifier):
    client, _ = classifier
    _, raw = await post(client, "/v1/embeddings", {"input": "hi"})
    error = error_of(raw, 400)
    assert error["param"] == "model" and "/classify" in error["message"]
    _, raw = await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert error_of(raw, 400)["param"] == "model"


async def test_classify_needs_a_classifier(client):
    _, raw = await post(client, "/classify", {"input": "hi"})
    error = error_of(raw, 400)
    assert error["param"] == "model" and "ForSequenceClassification" in error["message"]


def pair_ids(first: str, second: str) -> list[int]:
    return list(make_tokenizer()(first, second)["input_ids"])


async def test_a_cross_encoder_scores_each_pair_as_one_prompt(cross_encoder):
    client, engine = cross_encoder
    query, docs = "the quick brown fox", ["jumps over", "the lazy dog", "again and again"]
    expected = [float(class_probabilities(logits(pair_ids(query, d), 1))[0]) for d in docs]
    response, raw = await post(client, "/score", {"text_1": query, "text_2": docs})
    assert response.status == 200, raw
    body = response_json(raw)
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, rtol=1e-5)
    tokens = sum(len(pair_ids(query, d)) for d in docs)
    assert body["usage"]["prompt_tokens"] == tokens
    response, raw = await post(client, "/rerank", {"query": query, "documents": docs})
    results = response_json(raw)["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], sorted(expected, reverse=True), rtol=1e-5
    )
    assert_pool_free(engine)


async def test_scoring_needs_a_classifier_of_one_label(classifier):
    client, engine = classifier
    _, raw = await post(client, "/score", {"text_1": "a", "text_2": ["b"]})
    error = error_of(raw, 400)
    assert error["param"] == "model" and "one label" in error["message"]
    assert_pool_free(engine)


async def test_a_cross_encoder_truncates_pairs_and_names_the_long_text(cross_encoder):
    client, engine = cross_encoder
    query, document = "the quick brown fox " * 80, "a lazy dog"
    body = {"text_1": query, "text_2": [document], "truncate_prompt_tokens": 10}
    response, raw = await post(client, "/score", body)
    assert response.status == 200, raw
    kept = list(make_tokenizer()(query, document, truncation=True, max_length=10)["input_ids"])
    assert response_json(raw)["usage"]["prompt_tokens"] == len(kept) == 10
    expected = float(class_probabilities(logits(kept, 1))[0])
    assert response_json(raw)["data"][0]["score"] == pytest.approx(expected, rel=1e-5)
    # Without truncation the pair is too long: the 400 names the long text's field.
    _, raw = await post(client, "/score", {"text_1": query, "text_2": [document]})
    assert error_of(raw, 400)["param"] == "text_1"
    _, raw = await post(client, "/rerank", {"query": "fox", "documents": [query]})
    assert error_of(raw, 400)["param"] == "documents"
    assert_pool_free(engine)
