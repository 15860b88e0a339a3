"""Clients that send what no SDK would: header bytes that are not UTF-8, token ids outside the
vocabulary with echo, bodies without a length that run past the limit. Each gets its 4xx; the
server and the pool are unharmed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from aioinfer.server.http import bodies
from aioinfer.server.http.bodies import body_limit
from tests.server.conftest import assert_pool_free, build_engine

KEY = "sk-hostile-1"


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = await build_engine()
    yield eng
    await eng.shutdown()


async def raw_request(client: Any, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes as they are and read the whole answer (the connection is closed after it)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(head + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return answer


async def test_an_authorization_header_that_is_not_utf8_is_unauthorized(aiohttp_client, engine):
    client = await aiohttp_client(create_app(engine, ServerConfig(api_key=(KEY,))))
    head = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: Bearer \xff\xfe" + KEY.encode() + b"\r\n\r\n"
    )
    answer = await raw_request(client, head)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_request_id_that_is_not_utf8_is_refused_naming_the_header(
    aiohttp_client, engine, path
):
    """Its bytes once became the response's id, which then failed the JSON: a 500 after the
    whole generation. Such an id is a 400 naming the header, and is not echoed back."""
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if path.endswith("completions") and "chat" not in path:
        del body["messages"]
    else:
        del body["prompt"]
    payload = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n".encode()
        + b"X-Request-Id: \xe9\xff\r\n\r\n"
    )
    answer = await raw_request(client, head, payload)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    headers, reply = answer.split(b"\r\n\r\n", 1)
    assert orjson.loads(reply)["error"]["param"] == "X-Request-Id"
    assert b"x-request-id" not in headers.lower()
    assert_pool_free(engine)


async def test_echo_with_token_ids_outside_the_vocabulary_is_a_400(aiohttp_client, engine):
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    for prompt in ([-1], [2**63], [5, engine.info.vocab_size]):
        body = {"prompt": prompt, "echo": True, "max_tokens": 1}
        response = await client.post("/v1/completions", json=body)
        error = orjson.loads(await response.read())["error"]
        assert response.status == 400 and error["param"] == "prompt", error
    assert_pool_free(engine)


async def test_a_chunked_body_past_the_limit_is_refused_before_it_is_all_read(
    aiohttp_client, engine
):
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    limit = body_limit(engine)

    async def pieces() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(limit // (1 << 20) + 8):
            yield b"a" * (1 << 20)

    response = await client.post(
        "/v1/completions", data=pieces(), headers={"Content-Type": "application/json"}
    )
    assert response.status == 413
    assert "over the limit" in orjson.loads(await response.read())["error"]["message"]
    response = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
    assert response.status == 200


async def test_a_body_that_stops_coming_is_a_408(aiohttp_client, engine, monkeypatch):
    monkeypatch.setattr(bodies, "BODY_IDLE_TIMEOUT", 0.3)
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    reader, writer = await asyncio.open_connection(client.host, client.port)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 100\r\n\r\n"
    )
    writer.write(head.encode() + b'{"prompt": "')  # and then nothing
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    answer += await asyncio.wait_for(reader.readuntil(b"}}"), 5)
    writer.close()
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408")
    error = orjson.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert "stopped coming" in error["message"] and error["type"] == "RequestTimeoutError"
    response = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
    assert response.status == 200
