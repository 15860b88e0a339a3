"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the
official `anthropic` client, on the fake model (exact texts) and on a tiny random Llama (tools,
the same text as chat completions)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from tests.server.conftest import (
    API_KEYS,
    LiveServer,
    assert_pool_free,
    build_engine,
    chat_prompt_ids,
    expected_output,
)
from tests.server.responses.test_responses_api import tokens_of
from tests.server.serving.test_tools_http import WEATHER
from tests.server.test_disconnect import check_a_leaving_client_frees_its_blocks
from tests.server.test_http import post

WEATHER_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
TIME_TOOL = {"name": "get_time", "input_schema": {"type": "object"}}
HI = [{"role": "user", "content": "Hi"}]
# Renders everything a request can put in the prompt, so a test can read it back by counting.
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}"
    "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}>{% endfor %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
)


def sdk(server: LiveServer, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture
async def ant(live: LiveServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = sdk(live)
    yield client
    await client.close()


def envelope_error(raw: bytes, kind: str) -> str:
    """The message of an error in Anthropic's envelope, asserting its shape."""
    body = orjson.loads(raw)
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


def named_events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a stream, asserting the framing: `event: <type>` then its data, a blank
    line after each, no [DONE]."""
    assert b"[DONE]" not in raw
    blocks = raw.split(b"\n\n")
    assert blocks[-1] == b""
    events = []
    for block in blocks[:-1]:
        head, data = block.split(b"\n")
        payload = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + payload["type"].encode()
        events.append(payload)
    return events


def used_prompt(usage: Any) -> int:
    """The prompt's tokens: Anthropic counts those read from the cache apart."""
    return usage.input_tokens + usage.cache_read_input_tokens


# --------------------------------------------------------------------------- the fake model


async def test_a_message_holds_the_reference_text(ant, engine):
    message = await ant.messages.create(
        model=engine.model_name,
        system="Be brief.",
        messages=HI,
        max_tokens=6,  # type: ignore[arg-type]
    )
    prompt = chat_prompt_ids([{"role": "system", "content": "Be brief."}, *HI])
    ids, text = expected_output(prompt, 6)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == engine.model_name
    (block,) = message.content
    assert block.type == "text" and block.text == text
    # The fake model never stops by itself: the limit ends it.
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert used_prompt(message.usage) == len(prompt)
    assert message.usage.output_tokens == len(ids) == 6
    assert message.usage.cache_creation_input_tokens == 0
    assert_pool_free(engine)


async def test_a_streamed_message_tells_the_same_text_in_order(ant, engine):
    kwargs: dict[str, Any] = {"model": engine.model_name, "messages": HI, "max_tokens": 7}
    whole = await ant.messages.create(**kwargs)
    events = [event async for event in await ant.messages.create(**kwargs, stream=True)]
    kinds = [event.type for event in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    # The client skips the ping (test_stream_framing... sees it).
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0].message  # type: ignore[union-attr]
    assert start.content == [] and start.stop_reason is None and start.id.startswith("msg_")
    assert used_prompt(start.usage) == used_prompt(whole.usage)
    assert events[1].content_block.type == "text" and events[1].index == 0  # type: ignore[union-attr]
    assert {d.index for d in deltas} == {0}  # type: ignore[union-attr]
    text = "".join(d.delta.text for d in deltas)  # type: ignore[union-attr]
    assert text == whole.content[0].text  # type: ignore[union-attr]
    final = events[-2]
    assert final.delta.stop_reason == "max_tokens" and final.usage.output_tokens == 7  # type: ignore[union-attr]
    # The client's own stream helper puts the same message together.
    async with ant.messages.stream(**kwargs) as stream:
        assembled = await stream.get_final_message()
    assert assembled.content[0].text == text and assembled.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert assembled.usage.output_tokens == 7
    assert_pool_free(engine)


async def test_stream_framing_names_each_event_and_sends_no_done(client):
    body = {"messages": HI, "max_tokens": 3, "stream": True}
    response, raw = await post(client, "/v1/messages", body)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = named_events(raw)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", *["content_block_delta"] * 3,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"output_tokens": 3},
    }
    assert events[1] == {"type": "ping"}
    assert events[2] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert events[3]["delta"]["type"] == "text_delta" and events[6] == {
        "type": "content_block_stop",
        "index": 0,
    }


async def test_a_stop_sequence_ends_the_message_and_is_named(ant, engine):
    prompt = chat_prompt_ids(HI)
    _, text = expected_output(prompt, 8)
    stop = text[3:5]
    message = await ant.messages.create(
        model=engine.model_name,
        messages=HI,
        max_tokens=8,
        stop_sequences=[stop],  # type: ignore[arg-type]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


async def test_system_tool_use_tool_result_and_thinking_reach_the_template(
    client, engine, monkeypatch
):
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATE)
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Needs a call.", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Oslo", "unit": "C"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "-3 C"},
                {"type": "text", "text": "Answer now."},
            ]},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "none"},
        "max_tokens": 1,
    }  # fmt: skip
    expected = (
        "system:Be brief.;user:Weather in Oslo?;"
        "assistant[Needs a call.]:Let me look.<t1 get_weather Oslo>;"
        "tool:-3 C#t1;user:Answer now.;"
    )
    response, raw = await post(client, "/v1/messages", body)
    assert response.status == 200, raw
    usage = orjson.loads(raw)["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == tokens_of(expected)
    response, raw = await post(client, "/v1/messages/count_tokens", body)
    assert response.status == 200, raw
    assert orjson.loads(raw) == {"input_tokens": tokens_of(expected)}


async def test_count_tokens_is_the_chat_prompt_length(ant, engine):
    system = "Be brief."
    count = await ant.messages.count_tokens(model=engine.model_name, system=system, messages=HI)  # type: ignore[arg-type]
    assert count.input_tokens == len(chat_prompt_ids([{"role": "system", "content": system}, *HI]))
    assert engine.stats.prompt_tokens == 0 and not engine.stats.finished  # nothing generated
    # An empty system prompt is none.
    count = await ant.messages.count_tokens(model=engine.model_name, system=[], messages=HI)  # type: ignore[arg-type]
    assert count.input_tokens == len(chat_prompt_ids(HI))


async def test_a_last_assistant_message_is_a_prefill_the_answer_continues(ant, engine):
    prefill = [*HI, {"role": "assistant", "content": '{"a":'}]
    count = await ant.messages.count_tokens(model=engine.model_name, messages=prefill)  # type: ignore[arg-type]
    expected = chat_prompt_ids(prefill, False, continue_final_message=True)
    assert count.input_tokens == len(expected)
    message = await ant.messages.create(model=engine.model_name, messages=prefill, max_tokens=3)  # type: ignore[arg-type]
    assert message.content[0].text == expected_output(expected, 3)[1]  # type: ignore[union-attr]


async def test_with_deepseek_r1_reasoning_the_output_is_a_thinking_block(live_factory, engine):
    """deepseek_r1 reads the output as reasoning until `</think>`, which the fake model never
    writes: a thinking block, first, and no text."""
    server = await live_factory(engine, ServerConfig(reasoning_parser="deepseek_r1"))
    ant = sdk(server)
    kwargs: dict[str, Any] = {"model": engine.model_name, "messages": HI, "max_tokens": 5}
    message = await ant.messages.create(**kwargs)
    (block,) = message.content
    _, text = expected_output(chat_prompt_ids(HI), 5)
    assert block.type == "thinking" and block.thinking == text.strip()
    assert block.signature == "" and message.stop_reason == "max_tokens"
    events = [e async for e in await ant.messages.create(**kwargs, stream=True)]
    assert events[1].content_block.type == "thinking"  # type: ignore[union-attr]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"thinking_delta"}
    assert "".join(d.thinking for d in deltas) == block.thinking  # type: ignore[union-attr]
    await ant.close()


@pytest.mark.parametrize(
    ("body", "kind", "fragments"),
    [
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
        ]}]}, "invalid_request_error", ["messages[0].content", "'image'"]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}
        ]}]}, "invalid_request_error", ["messages[0].content[0].content", "'document'"]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}
        ]}]}, "invalid_request_error", ["messages[0].content[0]", "not allowed in user turns"]),
        ({"messages": [{"role": "system", "content": "x"}]}, "invalid_request_error",
         ["messages[0].role"]),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "invalid_request_error", ["tools[0]", "only client tools"]),
        ({"tools": [WEATHER_TOOL]}, "invalid_request_error",
         ["tool_choice", "--tool-call-parser", '{"type": "any"}']),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool"}}, "invalid_request_error",
         ["tool_choice", "needs a name"]),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
         "invalid_request_error", ["tool_choice", "not among the tools"]),
        ({"tool_choice": {"type": "any"}}, "invalid_request_error",
         ["tool_choice", "only allowed when tools"]),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "frob"}}}},
         "invalid_request_error", ["output_config.format is invalid", "frob"]),
        # named as this API names it (it once said response_format)
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"},
          "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
         "invalid_request_error", ["output_config.format and tool_choice cannot both"]),
        ({"max_tokens": 0}, "invalid_request_error", ["max_tokens", "greater than"]),
        ({"max_tokens": None}, "invalid_request_error", ["max_tokens"]),
        ({"max_tokens": 500}, "invalid_request_error", ["max_tokens", "context"]),
        ({"temperature": -1.0}, "invalid_request_error", ["temperature"]),
        ({"temperature": 1.5}, "invalid_request_error", ["temperature", "less than or equal to 1"]),
        ({"thinking": {"type": "sometimes"}}, "invalid_request_error", ["thinking.type"]),
        ({"container": "c1"}, "invalid_request_error", ["container", "not supported"]),
        ({"messages": [{"role": "user", "content": "word " * 200}]}, "invalid_request_error",
         ["messages", "context"]),
        ({"model": "other"}, "not_found_error", ["model", "does not exist"]),
    ],
)  # fmt: skip
async def test_requests_that_cannot_be_served_are_errors_in_anthropic_s_envelope(
    client, engine, body, kind, fragments
):
    full = {"messages": HI, "max_tokens": 4, **body}
    body = {key: value for key, value in full.items() if value is not None}
    response, raw = await post(client, "/v1/messages", body)
    assert response.status == (404 if kind == "not_found_error" else 400), raw
    message = envelope_error(raw, kind)
    for fragment in fragments:
        assert fragment in message, message
    # The message names the Messages fields, not the chat fields they become.
    assert not any(name in message for name in ("response_format", "max_completion_tokens"))
    assert_pool_free(engine)


async def test_the_client_raises_its_own_errors(ant, engine):
    with pytest.raises(anthropic.BadRequestError) as info:
        await ant.messages.create(model=engine.model_name, messages=HI, max_tokens=0)
    assert info.value.status_code == 400 and "max_tokens" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        await ant.messages.create(model="claude-nope", messages=HI, max_tokens=1)  # type: ignore[arg-type]


async def test_other_paths_and_methods_under_v1_messages_answer_in_the_envelope(client):
    response, raw = await post(client, "/v1/messages/batches", {})
    assert response.status == 404 and "/v1/messages/batches" in envelope_error(
        raw, "not_found_error"
    )
    response = await client.get("/v1/messages")
    assert response.status == 405
    envelope_error(await response.read(), "invalid_request_error")


async def test_the_messages_routes_take_x_api_key_or_bearer(aiohttp_client, engine):
    client = await aiohttp_client(create_app(engine, ServerConfig(api_key=API_KEYS)))
    body = {"messages": HI, "max_tokens": 2}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response, raw = await post(client, path, body)
        assert response.status == 401
        assert "x-api-key" in envelope_error(raw, "authentication_error")
        response, raw = await post(client, path, body, headers={"x-api-key": "wrong"})
        assert response.status == 401
        for headers in ({"x-api-key": API_KEYS[1]}, {"Authorization": f"Bearer {API_KEYS[0]}"}):
            response, raw = await post(client, path, body, headers=headers)
            assert response.status == 200, raw
    # Elsewhere, only the bearer key.
    response, raw = await post(
        client, "/v1/chat/completions", {"messages": HI}, headers={"x-api-key": API_KEYS[0]}
    )
    assert response.status == 401 and orjson.loads(raw)["error"]["type"] == "AuthenticationError"


async def test_the_anthropic_client_sends_its_key_as_x_api_key(live_factory, engine):
    server = await live_factory(engine, ServerConfig(api_key=API_KEYS))
    ant = sdk(server, api_key=API_KEYS[0])
    message = await ant.messages.create(model=engine.model_name, messages=HI, max_tokens=2)  # type: ignore[arg-type]
    assert message.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        await sdk(server, api_key="wrong").messages.create(
            model=engine.model_name,
            messages=HI,
            max_tokens=2,  # type: ignore[arg-type]
        )
    await ant.close()


async def test_the_openapi_document_has_the_messages_routes(client):
    paths = (await (await client.get("/openapi.json")).json())["paths"]
    assert "text/event-stream" in paths["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert "post" in paths["/v1/messages/count_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_frees_its_blocks(live_factory, stream):
    body = {"messages": HI, "max_tokens": 100, "stream": stream}
    marker = b"event: content_block_delta" if stream else None
    await check_a_leaving_client_frees_its_blocks(live_factory, "/v1/messages", body, marker)


async def test_an_engine_failure_mid_stream_is_an_error_event(aiohttp_client):
    engine = await build_engine(step_delay=0.02, fail_at_step=3)
    try:
        client = await aiohttp_client(create_app(engine))
        body = {"messages": HI, "max_tokens": 20, "stream": True}
        response, raw = await post(client, "/v1/messages", body)
        assert response.status == 200
        events = named_events(raw)
        assert events[0]["type"] == "message_start"
        assert events[-1]["type"] == "error"
        assert "device lost" in envelope_error(orjson.dumps(events[-1]), "api_error")
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------- a tiny real model


@pytest.fixture
async def real_ant(
    live_factory: Callable[..., Any], real_engine: Any
) -> AsyncIterator[tuple[anthropic.AsyncAnthropic, Any]]:
    server = await live_factory(real_engine)
    client = sdk(server)
    yield client, server
    await client.close()


async def test_the_text_is_what_chat_completions_give(real_ant, real_engine):
    ant, server = real_ant
    oai = server.openai()
    chat = await oai.chat.completions.create(
        model=real_engine.model_name,
        messages=[{"role": "system", "content": "Be brief."}, *HI],
        max_tokens=12,
        temperature=0,
    )
    await oai.close()
    message = await ant.messages.create(
        model=real_engine.model_name,
        system="Be brief.",
        messages=HI,  # type: ignore[arg-type]
        max_tokens=12,
        extra_body={"temperature": 0},  # not among the client's own arguments
    )
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == chat.choices[0].message.content
    assert chat.usage is not None and used_prompt(message.usage) == chat.usage.prompt_tokens
    finish = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
async def test_forced_tool_choice_gives_tool_use_blocks(real_ant, real_engine, stream, tool_choice):
    ant, _ = real_ant
    kwargs: dict[str, Any] = {
        "model": real_engine.model_name,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": {**tool_choice, "disable_parallel_tool_use": True},
        "max_tokens": 80,
        "extra_body": {"temperature": 0},  # not among the client's own arguments
    }
    partial_json = ""
    if stream:
        async with ant.messages.stream(**kwargs) as events:
            async for event in events:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    partial_json += event.delta.partial_json
            message = await events.get_final_message()
    else:
        message = await ant.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name in ("get_weather", "get_time") and isinstance(block.input, dict)
    if stream:
        assert json.loads(partial_json) == block.input
    if block.name == "get_weather":
        assert block.input["city"] in ("Paris", "Oslo") and block.input["unit"] in ("C", "F")  # type: ignore[index]
    assert_pool_free(real_engine)


async def test_an_output_format_gives_json_that_follows_the_schema(real_ant, real_engine):
    ant, _ = real_ant
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = await ant.messages.create(
        model=real_engine.model_name,
        messages=HI,  # type: ignore[arg-type]
        max_tokens=40,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0},
    )
    (block,) = message.content
    assert block.type == "text" and json.loads(block.text)["city"] in ("Paris", "Oslo")
    assert message.stop_reason == "end_turn"
    assert_pool_free(real_engine)
