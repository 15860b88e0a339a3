"""A client's X-Request-Id names the response (as in vLLM) and comes back as a header, on errors
too; requests that share one still run as separate engine requests."""

from __future__ import annotations

import asyncio
import re

import orjson

from tests.server.conftest import assert_pool_free
from tests.server.test_http import chunks_of, error_of, post

HEADERS = {"X-Request-Id": "trace-42"}


async def test_the_client_id_names_the_response_and_comes_back(client, engine):
    body = {"prompt": [5, 6, 7], "max_tokens": 4}
    # Two at once with the same id: both answered, each in full.
    answers = await asyncio.gather(
        *(post(client, "/v1/completions", body, headers=HEADERS) for _ in range(2))
    )
    texts = set()
    for response, raw in answers:
        assert response.status == 200 and response.headers["X-Request-Id"] == "trace-42"
        reply = orjson.loads(raw)
        assert reply["id"] == "cmpl-trace-42" and reply["usage"]["completion_tokens"] == 4
        texts.add(reply["choices"][0]["text"])
    assert len(texts) == 1
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    response, raw = await post(client, "/v1/chat/completions", chat, headers=HEADERS)
    assert response.headers["X-Request-Id"] == "trace-42"
    assert {c["id"] for c in chunks_of(raw)} == {"chatcmpl-trace-42"}
    assert_pool_free(engine)


async def test_the_body_s_request_id_names_the_response_unless_the_header_does(client, engine):
    """vLLM's request_id field: cmpl-<request_id>; X-Request-Id wins, as in vLLM's server. Two
    requests with the same one still run apart."""
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "request_id": "job-7"}
    answers = await asyncio.gather(*(post(client, "/v1/completions", body) for _ in range(2)))
    for response, raw in answers:
        assert response.status == 200 and orjson.loads(raw)["id"] == "cmpl-job-7"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "c1"}
    _, raw = await post(client, "/v1/chat/completions", chat)
    assert orjson.loads(raw)["id"] == "chatcmpl-c1"
    _, raw = await post(client, "/v1/completions", body, headers=HEADERS)
    assert orjson.loads(raw)["id"] == "cmpl-trace-42"
    response, raw = await post(client, "/v1/completions", {**body, "request_id": ""})
    assert response.status == 400 and error_of(raw, 400)["param"] == "request_id"
    assert_pool_free(engine)


async def test_errors_carry_the_id_and_responses_without_one_get_a_fresh_id(client):
    response, raw = await post(client, "/v1/completions", {"prompt": []}, headers=HEADERS)
    assert response.headers["X-Request-Id"] == "trace-42"
    error_of(raw, 400)
    response, raw = await post(client, "/v1/completions", {"prompt": [5], "max_tokens": 1})
    assert "X-Request-Id" not in response.headers
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", orjson.loads(raw)["id"])
