"""vLLM's server extras through aiohttp's test client: the routes SageMaker and routers probe
(/ping, /load, /invocations), the usage flags, and the warning that names ignored fields."""

from __future__ import annotations

import logging

import orjson

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from aioinfer.server.http import bodies
from aioinfer.server.http.state import STATE
from tests.server.conftest import BLOCK_SIZE, MODEL
from tests.server.test_http import MESSAGES, chunks_of, error_of, post


async def test_vllm_routes_for_sagemaker_and_routers(client):
    """/ping answers as /health (GET or POST); /load counts the requests being answered;
    /invocations takes a chat, completion or embedding body and answers as that route."""
    for method in ("GET", "POST"):
        response = await client.request(method, "/ping")
        assert response.status == 200 and await response.read() == b""
    assert (await client.put("/ping")).status == 405
    assert await (await client.get("/load")).json() == {"server_load": 0}

    chat = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    completion = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0}
    for body, route in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        _, direct = await post(client, route, body)
        response, raw = await post(client, "/invocations", body)
        assert response.status == 200
        expected, got = orjson.loads(direct), orjson.loads(raw)
        assert got["object"] == expected["object"] and got["choices"] == expected["choices"]
    response, raw = await post(client, "/invocations", {**chat, "stream": True})
    assert chunks_of(raw)[0]["object"] == "chat.completion.chunk"
    error = error_of((await post(client, "/invocations", {"model": MODEL}))[1], 400)
    assert "messages" in error["message"] and "prompt" in error["message"]

    # While a stream is being answered, /load counts it.
    response = await client.post("/v1/completions", json={**completion, "stream": True})
    await response.content.readline()  # the first event: the request is in flight
    assert await (await client.get("/load")).json() == {"server_load": 1}
    await response.read()
    assert await (await client.get("/load")).json() == {"server_load": 0}


async def test_vllm_usage_flags(aiohttp_client, engine):
    """--enable-force-include-usage: every stream ends with usage, asked for or not;
    --enable-prompt-tokens-details: usage counts the prompt tokens the prefix cache held."""
    config = ServerConfig(enable_force_include_usage=True, enable_prompt_tokens_details=True)
    client = await aiohttp_client(create_app(engine, config))
    prompt = list(range(5, 5 + 3 * BLOCK_SIZE))  # three full blocks
    body = {"prompt": prompt, "max_tokens": 2, "stream": True}
    _, raw = await post(client, "/v1/completions", body)
    last = chunks_of(raw)[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    _, raw = await post(client, "/v1/completions", body)  # the same prompt: cached now
    cached = chunks_of(raw)[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 2 * BLOCK_SIZE
    _, raw = await post(client, "/v1/completions", {**body, "stream": False})
    assert orjson.loads(raw)["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    chat = {"messages": MESSAGES, "max_tokens": 2}
    await post(client, "/v1/chat/completions", chat)
    _, raw = await post(client, "/v1/chat/completions", chat)
    assert orjson.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    plain = await aiohttp_client(create_app(engine, ServerConfig()))
    _, raw = await post(plain, "/v1/completions", body)
    assert "usage" not in chunks_of(raw)[-1]
    _, raw = await post(plain, "/v1/completions", {**body, "stream": False})
    assert "prompt_tokens_details" not in orjson.loads(raw)["usage"]


async def test_a_cache_salt_keeps_prefixes_within_it(aiohttp_client, engine):
    """vLLM's cache_salt, on completions and chat: a prompt cached under one salt is no hit for
    another salt, nor for none; the same salt hits. An empty salt is refused by name."""
    config = ServerConfig(enable_prompt_tokens_details=True)
    client = await aiohttp_client(create_app(engine, config))

    async def cached(route: str, body: dict, salt: str | None) -> int:
        body = {**body, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        _, raw = await post(client, route, body)
        return orjson.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]

    prompt = {"prompt": list(range(7, 7 + 3 * BLOCK_SIZE))}
    for route, body in (
        ("/v1/completions", prompt),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        assert await cached(route, body, "tenant-1") == 0
        assert await cached(route, body, "tenant-2") == 0
        assert await cached(route, body, None) == 0
        assert await cached(route, body, "tenant-1") >= BLOCK_SIZE
    error = error_of((await post(client, "/v1/completions", {**prompt, "cache_salt": ""}))[1], 400)
    assert error["param"] == "cache_salt"


async def test_the_responses_api_passes_its_cache_salt_on(client, engine, monkeypatch):
    """vLLM's ResponsesRequest has cache_salt too: dropped, a tenant would lose its isolation."""
    salts = []
    add_request = engine.add_request

    def recording(*args, **kwargs):
        salts.append(kwargs.get("cache_salt"))
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    body = {"input": "Hello", "max_output_tokens": 2, "store": False}
    for salt in ("tenant-1", None):
        response, _ = await post(
            client, "/v1/responses", body | ({"cache_salt": salt} if salt else {})
        )
        assert response.status == 200
    assert salts == ["tenant-1", None]
    long = {**body, "cache_salt": "x" * 1025}  # vLLM's limit: the salt is hashed every block
    assert error_of((await post(client, "/v1/responses", long))[1], 400)["param"] == "cache_salt"


async def test_ignored_fields_are_logged_once_each(client, caplog):
    """A field the request model does not know (a typo such as max_token) is served as if absent,
    as vLLM does, and named in a warning, once per field and kind of request."""
    caplog.set_level(logging.WARNING, logger="aioinfer.server")
    body = {"prompt": [5, 6], "max_tokens": 2, "max_token": 50, "foo": 1}

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "but ignored" in r.getMessage()]

    response, _ = await post(client, "/v1/completions", body)
    assert response.status == 200
    assert warned() == [
        "The following fields were present in the request but ignored: ['foo', 'max_token']"
    ]
    await post(client, "/v1/completions", body)  # the same fields again: not logged again
    await post(client, "/v1/completions", {"prompt": [5], "max_tokens": 1, "logprobs": 1})
    await post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "foo": 1})
    assert len(warned()) == 2 and "['foo']" in warned()[1]
    # Fields the server reads (refused when set) are not ignored ones.
    await post(
        client, "/v1/completions", {"prompt": [5], "max_tokens": 1, "use_beam_search": False}
    )
    assert len(warned()) == 2


async def test_made_up_fields_neither_fill_memory_nor_the_log(client, caplog):
    """A body of many made-up names: the line shows a few, what is remembered as logged stays
    bounded, and once it is full no further line is logged."""
    caplog.set_level(logging.WARNING, logger="aioinfer.server")
    junk = {f"x{i}": 0 for i in range(5000)}
    for body in (junk, junk, {"another_typo": 1}):
        response, _ = await post(client, "/v1/completions", {"prompt": [5], "max_tokens": 1,
                                                             **body})  # fmt: skip
        assert response.status == 200
    [line] = [r.getMessage() for r in caplog.records if "but ignored" in r.getMessage()]
    more = 5000 - bodies.MAX_IGNORED_FIELDS_SHOWN
    assert f" and {more} more (the last such warning: 1024 field names logged)" in line
    logged = client.app[STATE].ignored_fields_logged
    assert len(logged) == bodies.MAX_IGNORED_FIELDS_REMEMBERED
