"""Tool calling with tool_choice "required" or a named function, streamed and not, through the
official client, on a tiny random Llama: the calls come out well formed whatever the model."""

from __future__ import annotations

import json
from typing import Any

import openai
import orjson
import pytest

from aioinfer.config import ServerConfig
from tests.server.conftest import assert_pool_free
from tests.server.test_http import error_of, post
from tests.support.tokenizers import make_tokenizer

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
TOOLS: list[Any] = [WEATHER, TIME]


def _check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert value["city"] in ("Paris", "Oslo") and value["unit"] in ("C", "F")


def named_weather(engine) -> dict[str, Any]:
    """A chat request that must call get_weather."""
    return {
        "model": engine.model_name,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
    }


async def test_a_named_tool_choice_calls_that_function(real_oai, real_engine):
    oai, _ = real_oai
    reply = await oai.chat.completions.create(
        **named_weather(real_engine), n=2, temperature=1.0, seed=1
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("chatcmpl-tool-")
        _check_weather(call.function.arguments)
    assert reply.choices[0].message.tool_calls[0].id != reply.choices[1].message.tool_calls[0].id  # type: ignore[index]


async def test_a_named_tool_choice_streams_its_arguments(real_oai, real_engine):
    oai, _ = real_oai
    stream = await oai.chat.completions.create(
        **named_weather(real_engine), temperature=0, stream=True
    )
    heads, arguments, finish = [], "", None
    async for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                if call.id is not None:
                    heads.append((call.id, call.type, call.function and call.function.name))
                arguments += (call.function and call.function.arguments) or ""
            finish = choice.finish_reason or finish
    assert len(heads) == 1 and heads[0][1:] == ("function", "get_weather")
    assert finish == "stop"
    _check_weather(arguments)


@pytest.mark.parametrize("stream", [False, True])
async def test_required_tool_choice_makes_calls_to_the_given_tools(real_oai, real_engine, stream):
    oai, _ = real_oai
    kwargs: dict[str, Any] = {
        "model": real_engine.model_name,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 0,
        "parallel_tool_calls": False,  # the random model would go on calling to max_tokens
    }
    calls: list[tuple[str, str]] = []
    if not stream:
        reply = await oai.chat.completions.create(**kwargs)
        (choice,) = reply.choices
        finish = choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    else:
        finish = None
        async for chunk in await oai.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    assert call.function is not None and call.id
                    calls.append((call.function.name or "", call.function.arguments or ""))
                finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    for name, arguments in calls:
        assert name in ("get_weather", "get_time")
        if name == "get_weather":
            _check_weather(arguments)
        else:
            assert isinstance(json.loads(arguments), dict)
    assert_pool_free(real_engine)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"tools": TOOLS}, "--tool-call-parser hermes"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser hermes"),
        ({"tool_choice": "required"}, "only allowed when tools"),
        ({"tool_choice": "auto"}, "only allowed when tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot both",
        ),
    ],
)
async def test_tool_choice_that_cannot_be_served_is_a_400(real_oai, real_engine, body, fragment):
    _, server = real_oai
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, **body}
        ) as response,
    ):
        error = orjson.loads(await response.read())["error"]
    assert response.status == 400 and error["param"] == "tool_choice", error
    assert fragment in error["message"], error
    assert_pool_free(real_engine)


async def test_a_bad_parameters_schema_is_a_400_naming_tools(real_oai, real_engine):
    oai, _ = real_oai
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model=real_engine.model_name,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=[bad],  # type: ignore[list-item]
            tool_choice="required",
        )
    assert info.value.body["param"] == "tools"  # type: ignore[index]
    assert "parameters schema" in info.value.message


async def test_tools_and_tool_messages_reach_the_template(client, engine, monkeypatch):
    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "-3 C"},
    ]
    _, raw = await post(
        client,
        "/v1/chat/completions",
        {"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1},
    )
    expected = (
        "[get_weather][get_time]user:What is the weather in Paris?;assistant:"
        "<get_weather Oslo>;tool:-3 C#call-1;"
    )
    tokens = make_tokenizer().encode(expected, add_special_tokens=False)
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == len(tokens)
    _, raw = await post(client, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert orjson.loads(raw)["tokens"] == tokens
    # Arguments as an object or missing (vLLM takes both), for the template an object.
    for function in ({"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "f"}):
        history = [
            *messages[:1],
            {"role": "assistant", "tool_calls": [{**call, "function": function}]},
        ]
        _, raw = await post(client, "/tokenize", {"messages": history})
        city = function.get("arguments", {}).get("city", "")  # type: ignore[union-attr]
        text = f"user:What is the weather in Paris?;assistant:<{function['name']} {city}>;"
        assert orjson.loads(raw)["tokens"] == make_tokenizer().encode(
            text, add_special_tokens=False
        )
    no_function = {"id": "c", "type": "function"}
    _, raw = await post(
        client,
        "/v1/chat/completions",
        {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [no_function]}]},
    )
    assert "tool_calls" in error_of(raw, 400)["param"]


HERMES_TEXT = (
    'I will look it up.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"unit": "C"}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_tool_choice_reads_the_model_s_hermes_calls(live_factory, real_engine, stream):
    """The tiny model is made to write a Hermes call (a one-choice constraint), as Qwen does."""
    server = await live_factory(real_engine, ServerConfig(tool_call_parser="hermes"))
    oai = server.openai()
    kwargs: dict[str, Any] = {
        "model": real_engine.model_name,
        "messages": [{"role": "user", "content": "Hi"}],  # leaves room for the call
        "tools": TOOLS,
        "extra_body": {"structured_outputs": {"choice": [HERMES_TEXT]}},
    }
    if not stream:
        choice = (await oai.chat.completions.create(**kwargs)).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    else:
        content, finish, calls = "", None, []
        async for chunk in await oai.chat.completions.create(**kwargs, stream=True):
            for delta_choice in chunk.choices:
                content += delta_choice.delta.content or ""
                for call in delta_choice.delta.tool_calls or []:
                    assert call.index == len(calls) and call.id and call.function is not None
                    calls.append((call.function.name, call.function.arguments))
                finish = delta_choice.finish_reason or finish
    await oai.close()
    assert content == "I will look it up."
    assert finish == "tool_calls"
    assert [(name, json.loads(args or "")) for name, args in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]


async def test_required_takes_schemas_with_definitions_and_names_bad_tools(real_oai, real_engine):
    """pydantic's schemas keep nested models under $defs, which "required" must hoist."""
    oai, server = real_oai
    loc = {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}
    nested = {
        "type": "function",
        "function": {
            "name": "go",
            "parameters": {
                "type": "object",
                "$defs": {"Loc": loc},
                "properties": {"to": {"$ref": "#/$defs/Loc"}},
                "required": ["to"],
                "additionalProperties": False,
            },
        },
    }
    reply = await oai.chat.completions.create(
        model=real_engine.model_name,
        messages=[{"role": "user", "content": "Go"}],
        tools=[nested],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "go" and json.loads(call.function.arguments) == {
        "to": {"city": "Oslo"}
    }
    import aiohttp

    twice = {"messages": MESSAGES, "tools": [WEATHER, WEATHER], "tool_choice": "none"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/v1/chat/completions", json=twice) as response,
    ):
        error = orjson.loads(await response.read())["error"]
    assert response.status == 400 and error["param"] == "tools" and "distinct" in error["message"]
    # Definitions that are not an object: once a 500 from hoisting them
    for key in ("$defs", "definitions"):
        bad = {"type": "function", "function": {"name": "f", "parameters": {key: 5}}}
        body = {"messages": MESSAGES, "tools": [bad], "tool_choice": "required"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{server.url}/v1/chat/completions", json=body) as response,
        ):
            error = orjson.loads(await response.read())["error"]
        assert response.status == 400 and error["param"] == "tools", error
        assert f"{key} that is not an object" in error["message"]


async def test_a_named_call_cut_short_has_the_same_shape_streamed_or_not(real_oai, real_engine):
    oai, _ = real_oai
    kwargs: dict[str, Any] = {
        "model": real_engine.model_name,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 4,
        "temperature": 0,
    }
    choice = (await oai.chat.completions.create(**kwargs)).choices[0]
    (call,) = choice.message.tool_calls or []
    assert choice.finish_reason == "length" and choice.message.content is None
    arguments, finish = "", None
    async for chunk in await oai.chat.completions.create(**kwargs, stream=True):
        for streamed in chunk.choices:
            for delta in streamed.delta.tool_calls or []:
                arguments += (delta.function and delta.function.arguments) or ""
            finish = streamed.finish_reason or finish
    assert finish == "length" and arguments == call.function.arguments
    assert call.function.arguments.startswith('{"')


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_tool_choice_reads_llama3_json_calls(live_factory, real_engine, stream):
    server = await live_factory(real_engine, ServerConfig(tool_call_parser="llama3_json"))
    oai = server.openai()
    text = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}'
    kwargs: dict[str, Any] = {
        "model": real_engine.model_name,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": TOOLS,
        "extra_body": {"structured_outputs": {"choice": [text]}},
    }
    if not stream:
        choice = (await oai.chat.completions.create(**kwargs)).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    else:
        content, finish, calls = None, None, []
        async for chunk in await oai.chat.completions.create(**kwargs, stream=True):
            for delta_choice in chunk.choices:
                content = (content or "") + (delta_choice.delta.content or "") or None
                for call in delta_choice.delta.tool_calls or []:
                    calls.append((call.function.name, call.function.arguments))
                finish = delta_choice.finish_reason or finish
    await oai.close()
    assert not content and finish == "tool_calls"
    assert [(name, json.loads(args or "")) for name, args in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]


async def test_auto_with_parallel_tool_calls_false_keeps_the_first_call(live_factory, real_engine):
    server = await live_factory(real_engine, ServerConfig(tool_call_parser="llama3_json"))
    oai = server.openai()
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}'
    reply = await oai.chat.completions.create(
        model=real_engine.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        tools=TOOLS,
        parallel_tool_calls=False,
        extra_body={"structured_outputs": {"choice": [text]}},
    )
    await oai.close()
    message = reply.choices[0].message
    assert [c.function.name for c in message.tool_calls or []] == ["get_time"]
    assert not message.content and reply.choices[0].finish_reason == "tool_calls"
