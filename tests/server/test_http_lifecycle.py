"""The HTTP server's lifecycle: /health while the engine loads and once it serves, a start
that fails, an engine that dies with requests in flight or mid-stream, and the drain at
shutdown."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from aioinfer.server.app import create_app, wait_for_engine
from aioinfer.server.http.state import STATE
from tests.server.conftest import build_engine
from tests.server.test_http import MESSAGES, error_of, post, sse_events


async def test_health_while_loading_then_serving(aiohttp_client):
    release = asyncio.Event()
    built = []

    async def factory():
        await release.wait()
        engine = await build_engine()
        built.append(engine)
        return engine

    app = create_app(factory)
    client = await aiohttp_client(app)
    response = await client.get("/health")
    assert response.status == 503 and "loading" in error_of(await response.read(), 503)["message"]
    response, raw = await post(client, "/v1/completions", {"prompt": "a"})
    assert error_of(raw, 503)["type"] == "ServiceUnavailableError"
    assert (await client.get("/version")).status == 200
    assert (await client.get("/metrics")).status == 200
    release.set()
    engine = await asyncio.wait_for(wait_for_engine(app), 10)
    assert (await client.get("/health")).status == 200
    response, _ = await post(client, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert response.status == 200
    await client.close()  # the app owns the engine it built: cleanup shuts it down
    assert built == [engine] and not engine.ready


async def test_startup_failure_is_reported(aiohttp_client):
    errors = []

    async def factory():
        raise RuntimeError("no weights")

    app = create_app(factory, on_fatal=errors.append)
    client = await aiohttp_client(app)
    with pytest.raises(RuntimeError, match="no weights"):
        await asyncio.wait_for(wait_for_engine(app), 5)
    response = await client.get("/health")
    assert "no weights" in error_of(await response.read(), 503)["message"]
    assert [str(e) for e in errors] == ["no weights"]


async def test_a_configuration_error_is_logged_in_one_line(aiohttp_client, caplog):
    """A ValueError is what the configuration checks raise: its message, no traceback. Any
    other error is a bug, whose traceback is kept."""

    async def factory():
        raise ValueError("max_model_len (9999) is larger than the model's maximum length")

    caplog.set_level(logging.ERROR, logger="aioinfer")
    app = create_app(factory)
    await aiohttp_client(app)
    with pytest.raises(ValueError):
        await asyncio.wait_for(wait_for_engine(app), 5)
    [record] = caplog.records
    assert record.getMessage() == (
        "the engine failed to start: max_model_len (9999) is larger than the model's maximum length"
    )
    assert record.exc_info is None

    async def buggy():
        raise KeyError("layers")

    caplog.clear()
    app = create_app(buggy)
    await aiohttp_client(app)
    with pytest.raises(KeyError):
        await asyncio.wait_for(wait_for_engine(app), 5)
    [record] = caplog.records
    assert record.getMessage() == "the engine failed to start" and record.exc_info is not None


async def test_engine_death_500_in_flight_then_503(aiohttp_client):
    engine = await build_engine(fail_at_step=3)
    fatal = []
    try:
        client = await aiohttp_client(create_app(engine, on_fatal=fatal.append))
        body = {"prompt": [5], "max_tokens": 20, "ignore_eos": True}
        response, raw = await post(client, "/v1/completions", body)
        error = error_of(raw, 500)
        assert error["type"] == "InternalServerError" and "device lost" in error["message"]
        response = await client.get("/health")
        assert response.status == 503
        response, raw = await post(client, "/v1/completions", body)
        assert error_of(raw, 503)["type"] == "ServiceUnavailableError"
        for _ in range(100):
            if fatal:
                break
            await asyncio.sleep(0.01)
        assert [str(e) for e in fatal] == ["device lost"]
    finally:
        await engine.shutdown()


async def test_engine_death_mid_stream_is_an_in_band_error(aiohttp_client):
    # Slow steps: the first tokens are surely written (the stream started) before step 3 fails.
    engine = await build_engine(step_delay=0.02, fail_at_step=3)
    try:
        client = await aiohttp_client(create_app(engine))
        body = {"messages": MESSAGES, "max_tokens": 20, "stream": True}
        response, raw = await post(client, "/v1/chat/completions", body)
        assert response.status == 200
        payloads = sse_events(raw)
        last = orjson.loads(payloads[-1])
        error = last["error"]
        assert error["code"] == 500 and error["type"] == "InternalServerError"
        assert "device lost" in error["message"]
        assert orjson.loads(payloads[0])["choices"][0]["delta"]["role"] == "assistant"
    finally:
        await engine.shutdown()


async def test_shutdown_drains(client):
    await client.app.shutdown()  # what the runner does first on SIGTERM
    response = await client.get("/health")
    assert "shutting down" in error_of(await response.read(), 503)["message"]
    assert client.app[STATE].draining
