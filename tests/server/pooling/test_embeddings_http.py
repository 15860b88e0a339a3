"""POST /v1/embeddings over the fake runner (its hidden states read the KV cache back): the
official client's default base64 and plain floats, every input shape, usage, ids, and a 400 that
names the field for what cannot be served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.core.pooling import PoolerConfig
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from tests.server.conftest import MODEL, assert_pool_free, build_engine, text_prompt_ids
from tests.server.test_disconnect import raw_request, wait_until
from tests.server.test_http import error_of, post
from tests.support.fake_runner import FAKE_HIDDEN, reference_pooled


def expected(prompt: list[int], pooling: str = "LAST", dims: int | None = None) -> np.ndarray:
    vector = reference_pooled(prompt, pooling)[:dims]
    return vector / np.linalg.norm(vector)


@pytest.fixture
async def pooling_engine() -> AsyncIterator[AsyncEngine]:
    # A budget of 8 tokens: most inputs are pooled over several chunks.
    engine = await build_engine(pooler=PoolerConfig("MEAN"), max_num_batched_tokens=8)
    yield engine
    await engine.shutdown()


@pytest.fixture
async def pooling_client(aiohttp_client: Callable[..., Any], pooling_engine: AsyncEngine) -> Any:
    return await aiohttp_client(create_app(pooling_engine, ServerConfig()))


async def test_the_openai_client_gets_each_inputs_embedding(live_factory, pooling_engine):
    server = await live_factory(pooling_engine)
    client = server.openai()
    texts = ["The quick brown fox", "jumps over", "the lazy dog, again and again and again"]
    try:
        # The client asks for base64 unless told otherwise, and decodes it.
        as_base64 = await client.embeddings.create(model=MODEL, input=texts)
        as_floats = await client.embeddings.create(
            model=MODEL, input=texts, encoding_format="float"
        )
    finally:
        await client.close()
    ids = [text_prompt_ids(t) for t in texts]
    for result in (as_base64, as_floats):
        assert result.model == MODEL and result.object == "list"
        assert [d.index for d in result.data] == [0, 1, 2]
        for data, prompt in zip(result.data, ids, strict=True):
            assert data.object == "embedding"
            np.testing.assert_allclose(data.embedding, expected(prompt, "MEAN"), rtol=1e-5)
        assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    assert_pool_free(pooling_engine)


async def test_token_id_inputs_dimensions_and_normalize(pooling_client, pooling_engine):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41]]
    response, raw = await post(
        pooling_client, "/v1/embeddings", {"input": prompts, "dimensions": 3}
    )
    assert response.status == 200, raw
    body = response_json(raw)
    for data, prompt in zip(body["data"], prompts, strict=True):
        np.testing.assert_allclose(data["embedding"], expected(prompt, "MEAN", 3), rtol=1e-5)
    assert body["id"].startswith("embd-") and body["usage"]["prompt_tokens"] == 13
    response, raw = await post(
        pooling_client,
        "/v1/embeddings",
        {"input": prompts[0], "normalize": False},
        headers={"X-Request-Id": "mine"},
    )
    body = response_json(raw)
    assert body["id"] == "embd-mine"
    # One end-to-end latency per input, in the histogram generation requests fill.
    metrics = await (await pooling_client.get("/metrics")).text()
    assert 'e2e_request_latency_seconds_count{model_name="fake-model"} 3.0' in metrics
    np.testing.assert_allclose(
        body["data"][0]["embedding"], reference_pooled(prompts[0], "MEAN"), rtol=1e-5
    )
    assert_pool_free(pooling_engine)


def response_json(raw: bytes) -> dict[str, Any]:
    return orjson.loads(raw)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": "hi", "dimensions": 0}, "dimensions", "dimensions must be >= 1"),
        ({"input": "hi", "dimensions": FAKE_HIDDEN + 1}, "dimensions", "dimensions must be <="),
        ({"input": [[5] * 129]}, "input", "you requested 129 tokens in the input"),
        ({"input": []}, "input", "must be a string, a list of strings"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "hi", "priority": 1}, "priority", "--scheduling-policy priority"),
        ({"input": [5, 10**6]}, "input", "token ids must be in"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1 or -1"),
    ],
)
async def test_bad_requests_name_the_field(pooling_client, pooling_engine, body, param, fragment):
    _response, raw = await post(pooling_client, "/v1/embeddings", body)
    error = error_of(raw, 400)
    assert error["param"] == param and fragment in error["message"], error
    assert_pool_free(pooling_engine)


async def test_too_many_inputs_name_the_input(pooling_client):
    _, raw = await post(pooling_client, "/v1/embeddings", {"input": [[5]] * 5000})
    error = error_of(raw, 400)
    assert error["param"] == "input" and "at most 4096" in error["message"]


async def test_a_long_input_is_cut_when_asked(pooling_client):
    response, raw = await post(
        pooling_client, "/v1/embeddings", {"input": [[7] * 300], "truncate_prompt_tokens": -1}
    )
    assert response.status == 200, raw
    assert response_json(raw)["usage"]["prompt_tokens"] == 128


async def test_a_pooling_server_does_not_generate_and_still_tokenizes(pooling_client):
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi"}),
    ):
        response, raw = await post(pooling_client, path, body)
        error = error_of(raw, 400)
        assert error["param"] == "model" and "serves embeddings" in error["message"]
    response, raw = await post(pooling_client, "/tokenize", {"prompt": "hi"})
    assert response.status == 200 and response_json(raw)["count"] == len(text_prompt_ids("hi"))
    response = await pooling_client.get("/v1/models")
    assert response.status == 200


async def test_a_text_generation_server_refuses_embeddings(client, engine):
    _, raw = await post(client, "/v1/embeddings", {"input": "hi"})
    error = error_of(raw, 400)
    assert error["param"] == "model" and "--runner pooling" in error["message"]
    _response, raw = await post(client, "/v1/embeddings", {"input": "hi", "model": "other"})
    assert error_of(raw, 404)["param"] == "model"
    assert_pool_free(engine)


async def test_a_client_that_leaves_aborts_every_input(live_factory):
    # 20 ms a step and 8 tokens a step: 40 inputs of 30 tokens would take seconds.
    engine = await build_engine(
        step_delay=0.02, pooler=PoolerConfig("LAST"), max_num_batched_tokens=8
    )
    try:
        server = await live_factory(engine)
        body = {"input": [[5 + i % 40] * 30 for i in range(40)]}
        _, writer = await raw_request(server, "/v1/embeddings", body)
        await wait_until(lambda: engine.scheduler.num_running > 0)
        writer.close()
        await wait_until(lambda: engine.num_unfinished == 0, timeout=1.0)
        # Every input not done when the client left (a few may be) was aborted at once.
        aborted = engine.stats.aborted_by_reason
        assert set(aborted) == {"client_disconnect"} and aborted["client_disconnect"] >= 30
        assert aborted["client_disconnect"] + engine.stats.finished.get("stop", 0) == 40
        await asyncio.sleep(0)
        assert_pool_free(engine)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": [[5 + i] * 16 for i in range(24)]}),
        ("/v1/completions", {"prompt": [[5 + i] * 16 for i in range(24)], "max_tokens": 1}),
    ],
)
async def test_a_batch_that_started_is_not_timed_out_behind_itself(aiohttp_client, path, body):
    """--queue-timeout counts until a request's first step: the later prompts of a batch wait
    behind its earlier ones, not for a free server, and the batch succeeds."""
    pooler = PoolerConfig() if path == "/v1/embeddings" else None
    engine = await build_engine(
        step_delay=0.02, pooler=pooler, max_num_batched_tokens=16, queue_timeout=0.1
    )
    try:
        client = await aiohttp_client(create_app(engine, ServerConfig()))
        response, raw = await post(client, path, body)
        assert response.status == 200, raw  # 24 steps of 20 ms: far past the timeout
        assert engine.stats.aborted == 0
    finally:
        await engine.shutdown()


async def test_truncation_beyond_the_context_names_its_field(pooling_client):
    _, raw = await post(
        pooling_client, "/v1/embeddings", {"input": [5] * 10, "truncate_prompt_tokens": 500}
    )
    error = error_of(raw, 400)
    assert error["param"] == "truncate_prompt_tokens" and "must be <= 128" in error["message"]


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


async def test_score_one_to_many_and_pairwise(pooling_client, pooling_engine):
    query, docs = "the quick brown fox", ["jumps over", "the lazy dog", "the quick brown fox"]
    ref = {t: reference_pooled(text_prompt_ids(t), "MEAN") for t in [query, *docs]}
    for path in ("/score", "/v1/score"):
        response, raw = await post(pooling_client, path, {"text_1": query, "text_2": docs})
        assert response.status == 200, raw
        body = response_json(raw)
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        expected = [cos(ref[query], ref[d]) for d in docs]
        np.testing.assert_allclose([d["score"] for d in body["data"]], expected, rtol=1e-5)
        assert body["data"][2]["score"] == pytest.approx(1.0)
        # Usage counts each pair's texts, though each distinct text is embedded once.
        pair_tokens = sum(len(text_prompt_ids(query)) + len(text_prompt_ids(d)) for d in docs)
        assert body["usage"]["prompt_tokens"] == pair_tokens
    response, raw = await post(
        pooling_client, "/score", {"text_1": docs[:2], "text_2": [query, docs[0]]}
    )
    scores = [d["score"] for d in response_json(raw)["data"]]
    np.testing.assert_allclose(scores, [cos(ref[docs[0]], ref[query]), 1.0], rtol=1e-5)
    assert_pool_free(pooling_engine)


async def test_rerank_orders_the_documents(pooling_client):
    query = "the quick brown fox"
    docs = ["jumps over", "the quick brown fox", "the lazy dog", "again and again"]
    ref = {t: reference_pooled(text_prompt_ids(t), "MEAN") for t in [query, *docs]}
    expected = sorted(range(4), key=lambda i: -cos(ref[query], ref[docs[i]]))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        response, raw = await post(pooling_client, path, {"query": query, "documents": docs})
        assert response.status == 200, raw
        results = response_json(raw)["results"]
        assert [r["index"] for r in results] == expected and expected[0] == 1
        assert [r["document"]["text"] for r in results] == [docs[i] for i in expected]
        scores = [r["relevance_score"] for r in results]
        np.testing.assert_allclose(scores, [cos(ref[query], ref[docs[i]]) for i in expected])
    # Documents as Jina's and Cohere v1's objects; only the best two, without their text.
    response, raw = await post(
        pooling_client,
        "/rerank",
        {
            "query": query,
            "documents": [{"text": d} for d in docs],
            "top_n": 2,
            "return_documents": False,
        },
    )
    results = response_json(raw)["results"]
    assert [r["index"] for r in results] == expected[:2]
    assert all("document" not in r for r in results)


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "as many as"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2", "must not be empty"),
        ("/rerank", {"query": "a", "documents": []}, "documents", "must not be empty"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", ">= 0"),
        ("/rerank", {"query": "a", "documents": [1]}, "documents[0]", "string"),
        ("/rerank", {"query": "", "documents": ["b"]}, "query", "must not be empty"),
        ("/rerank", {"query": "b " * 200, "documents": ["b"]}, "query", "maximum context"),
        ("/score", {"text_1": "", "text_2": ["b"]}, "text_1", "must not be empty"),
        ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2", "must not be empty"),
        ("/score", {"text_1": [1], "text_2": "b"}, "text_1[0]", "text_1[0]: Input should be"),
        (
            "/rerank",
            {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
            ">= 1 or -1",
        ),
    ],
)
async def test_bad_score_and_rerank_requests_name_the_field(
    pooling_client, pooling_engine, path, body, param, fragment
):
    _, raw = await post(pooling_client, path, body)
    error = error_of(raw, 400)
    assert error["param"] == param and fragment in error["message"], error
    assert_pool_free(pooling_engine)


async def test_a_text_generation_server_refuses_scores(client):
    for path, body in (
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ):
        _, raw = await post(client, path, body)
        assert error_of(raw, 400)["param"] == "model"
