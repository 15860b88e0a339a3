"""Bad input classes beyond tests/server/test_http.py: each is a 400 with OpenAI's error body,
the right type and `param`, and none reaches the engine (the pool stays free)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from aioinfer.config import SchedulerConfig, ServerConfig
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from aioinfer.server.http.bodies import MAX_JSON_DEPTH, json_depth
from tests.server.conftest import assert_pool_free, build_engine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = await build_engine()
    yield eng
    await eng.shutdown()


@pytest.fixture
async def client(aiohttp_client: Any, engine: AsyncEngine) -> Any:
    return await aiohttp_client(create_app(engine, ServerConfig()))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        # Wrong types are never coerced.
        (COMPLETIONS, {"prompt": "a", "max_tokens": 1.5}, "max_tokens", "valid integer"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 2.0}, "max_tokens", "valid integer"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": True}, "max_tokens", "valid integer"),
        (COMPLETIONS, {"prompt": "a", "n": "2"}, "n", "valid integer"),
        (COMPLETIONS, {"prompt": "a", "stream": "yes"}, "stream", "valid boolean"),
        (COMPLETIONS, {"prompt": "a", "temperature": "0.5"}, "temperature", "valid number"),
        (COMPLETIONS, {"prompt": ["a", 1]}, "prompt", "must be a string"),
        (COMPLETIONS, {"prompt": [[]]}, "prompt", "none of them empty"),
        (COMPLETIONS, {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        # Out of range.
        (COMPLETIONS, {"prompt": "a", "top_p": 0}, "top_p", "(0, 1]"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens", ">= 1"),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, "min_tokens", "<="),
        (COMPLETIONS, {"prompt": "a", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
        (COMPLETIONS, {"prompt": "a", "logit_bias": {"5": 500}}, "logit_bias", "[-100, 100]"),
        # Stop strings: none empty, not too many.
        (COMPLETIONS, {"prompt": "a", "stop": [""]}, "stop", "empty"),
        (COMPLETIONS, {"prompt": "a", "stop": ["x"] * 40}, "stop", "at most 32"),
        # Token ids outside the vocabulary, wherever they are.
        (COMPLETIONS, {"prompt": [-1]}, "prompt", "[0, 4096)"),
        (COMPLETIONS, {"prompt": [5], "stop_token_ids": [99999]}, "stop_token_ids", "vocab"),
        # Server limits.
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "<= 20"),
        (COMPLETIONS, {"prompt": "a", "n": 10**9}, "n", "n must be at most 256"),
        (COMPLETIONS, {"prompt": ["a"] * 64, "n": 65}, "prompt", "at most 4096"),
        # Chat roles and content parts.
        (CHAT, {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "'user'"),
        (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id",
         "required"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content", "only text"),
        (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role", "required"),
        (CHAT, {"model": "x"}, "messages", "required"),
        # Known but unsupported.
        (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, "response_format",
         "needs json_schema.schema"),
        (CHAT, {"messages": USER, "tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
        (COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}},
         "stream_options", "only allowed when stream"),
    ],
)  # fmt: skip
async def test_bad_fields_name_the_param(client, engine, path, body, param, fragment):
    response = await client.post(path, json=body)
    error = orjson.loads(await response.read())["error"]
    assert response.status == 400 and error["code"] == 400
    assert error["type"] == "BadRequestError" and error["param"] == param
    assert fragment in error["message"], error["message"]
    assert_pool_free(engine)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b'{"prompt": ' + nested(MAX_JSON_DEPTH + 1) + b"}", "nested too deeply"),
        (b'{"prompt": "a", "user": ' + nested(5000) + b"}", "nested too deeply"),
        (nested(1_000_000), "nested too deeply"),
        (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "surrogate"),
        (b'{"prompt": "ok\xc3\x28"}', "UTF-8"),
    ],
)
async def test_bodies_refused_before_parsing_fields(client, engine, data, fragment):
    response = await client.post(CHAT, data=data, headers={"Content-Type": "application/json"})
    error = orjson.loads(await response.read())["error"]
    assert response.status == 400 and error["type"] == "BadRequestError"
    assert fragment in error["message"], error["message"]
    assert_pool_free(engine)


async def test_nesting_within_the_limit_and_brackets_in_strings_are_fine(client):
    text = "[{" * 40  # brackets inside strings are text, not nesting
    body = orjson.dumps({"prompt": text, "max_tokens": 2})[:-1] + b', "zzz": ' + nested(40) + b"}"
    response = await client.post(
        COMPLETIONS, data=body, headers={"Content-Type": "application/json"}
    )
    assert response.status == 200, await response.read()
    messages = [{"role": "user", "content": [{"type": "text", "text": "[{"}]}] * 8
    response = await client.post(CHAT, json={"messages": messages, "max_tokens": 1})
    assert response.status == 200, await response.read()


@pytest.mark.timeout(60)
async def test_an_unterminated_string_of_escapes_is_refused_at_once(client):
    # Scanned for depth before parsing, each of its quotes started a string that ran to the
    # end: quadratic, and this body held the event loop for most of an hour.
    body = b"[" * 65 + b'"\\' * 500_000
    response = await client.post(CHAT, data=body, headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert "not valid JSON" in orjson.loads(await response.read())["error"]["message"]


def test_json_depth():
    assert json_depth(b'{"a": [1, {"b": [2]}]}') == 4
    assert json_depth(b'{"a": "[[[[", "b": "\\"[{", "c": []}') == 2
    assert json_depth(nested(10**6)) == 10**6
    assert json_depth(b'"' + b"[" * 100) == 100  # an unterminated string hides nothing
    assert json_depth(b"[1, 2]", at_least=64) <= 64


@pytest.mark.parametrize(
    ("cls", "values", "fragment"),
    [
        (ServerConfig, {"stream_write_timeout": 0}, "stream_write_timeout must be > 0"),
        (ServerConfig, {"body_read_timeout": 0}, "body_read_timeout must be > 0"),
        (ServerConfig, {"sse_keep_alive_interval": -1}, "sse_keep_alive_interval must be >= 0"),
        (ServerConfig, {"shutdown_timeout": -1}, "shutdown_timeout must be >= 0"),
        (ServerConfig, {"watchdog_timeout": -1}, "watchdog_timeout must be >= 0"),
        (ServerConfig, {"watchdog_timeout": float("nan")}, "watchdog_timeout must be >= 0"),
        (SchedulerConfig, {"queue_timeout": float("nan")}, "queue_timeout must be a finite"),
        (SchedulerConfig, {"queue_timeout": 0}, "queue_timeout must be > 0"),
        (SchedulerConfig, {"max_queued_requests": 0}, "max_queued_requests must be > 0"),
        (SchedulerConfig, {"max_queued_tokens": 0}, "max_queued_tokens must be > 0"),
    ],
)
def test_reliability_flags_are_validated(cls, values, fragment):
    with pytest.raises(ValueError, match=fragment):
        cls(**values)
