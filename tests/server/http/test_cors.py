"""--allowed-origins: browsers of the allowed origins may call the API (preflights answered
without a key; every answer, errors and streams too, readable); others get no CORS headers,
and none are sent by default."""

from __future__ import annotations

import pytest

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from tests.server.conftest import API_KEYS

APP = "https://chat.example.com"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"prompt": "Hello", "max_tokens": 2}


async def _client(aiohttp_client, engine, origins):
    config = ServerConfig(allowed_origins=origins, api_key=API_KEYS)
    return await aiohttp_client(create_app(engine, config))


async def test_an_allowed_origin_gets_its_preflight_and_readable_answers(aiohttp_client, engine):
    client = await _client(aiohttp_client, engine, (APP,))
    response = await client.options("/v1/completions", headers=PREFLIGHT)
    assert response.status == 204
    assert response.headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    key = {"Origin": APP, "Authorization": f"Bearer {API_KEYS[0]}"}
    for body in (BODY, {**BODY, "stream": True}):
        response = await client.post("/v1/completions", json=body, headers=key)
        await response.read()
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == APP
        assert "Origin" in response.headers.getall("Vary")
        assert response.headers["Access-Control-Expose-Headers"] == "X-Request-Id"
    # An error is readable too: the browser app can show why.
    response = await client.post("/v1/completions", json=BODY, headers={"Origin": APP})
    assert response.status == 401
    assert response.headers["Access-Control-Allow-Origin"] == APP


@pytest.mark.parametrize("origins", [(), (APP,)])
async def test_other_origins_get_no_cors_headers(aiohttp_client, engine, origins):
    client = await _client(aiohttp_client, engine, origins)
    other = {**PREFLIGHT, "Origin": "https://elsewhere.example.com"}
    for headers in (other, PREFLIGHT) if not origins else (other,):
        response = await client.options("/v1/completions", headers=headers)
        assert response.status != 204
        assert "Access-Control-Allow-Origin" not in response.headers
    key = {"Origin": other["Origin"], "Authorization": f"Bearer {API_KEYS[0]}"}
    response = await client.post("/v1/completions", json=BODY, headers=key)
    assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers


async def test_any_origin(aiohttp_client, engine):
    client = await _client(aiohttp_client, engine, ("*",))
    response = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert response.status == 204 and response.headers["Access-Control-Allow-Origin"] == "*"
    response = await client.get("/health", headers={"Origin": "https://any.example.com"})
    assert response.headers["Access-Control-Allow-Origin"] == "*"
    assert "Vary" not in response.headers


def test_origins_are_checked_and_vllm_s_json_list_is_taken():
    from aioinfer.config import ServerConfig as Config

    listed = Config(allowed_origins=('["https://a.example", "http://localhost:3000"]',))
    assert listed.allowed_origins == ("https://a.example", "http://localhost:3000")
    for bad in ("http://localhost:3000/", "a.example", "https://a.example/app"):
        with pytest.raises(ValueError, match="scheme://host"):
            Config(allowed_origins=(bad,))


async def test_answers_vary_on_origin_whatever_it_is(aiohttp_client, engine):
    """A cache must not hand the answer without CORS headers to the allowed app."""
    client = await _client(aiohttp_client, engine, (APP,))
    for headers in ({}, {"Origin": "https://elsewhere.example.com"}):
        response = await client.get("/health", headers=headers)
        assert "Origin" in response.headers.getall("Vary", [])
