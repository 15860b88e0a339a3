"""POST /v1/responses (and GET / DELETE of stored responses) through the official client, on
the fake model (exact texts) and on a tiny random Llama (constraints, tools, the same text as
chat completions)."""

from __future__ import annotations

import gc
import json
import tracemalloc
from typing import Any, Literal

import aiohttp
import openai
import orjson
import pytest
from pydantic import BaseModel

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from aioinfer.server.responses.protocol import MAX_INPUT_ITEMS
from aioinfer.server.responses.state import RESPONSES
from tests.server.conftest import (
    API_KEYS,
    assert_pool_free,
    build_engine,
    chat_prompt_ids,
    expected_output,
)
from tests.server.serving.test_tools_http import WEATHER, _check_weather
from tests.server.test_disconnect import check_a_leaving_client_frees_its_blocks
from tests.server.test_http import error_of, post
from tests.support.tokenizers import make_tokenizer

WEATHER_TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat shape
TIME_TOOL = {"type": "function", "name": "get_time"}
# Renders everything a request can put in the prompt, so a test can read it back by counting.
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}>{% endfor %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
)


def tokens_of(text: str) -> int:
    return len(make_tokenizer().encode(text, add_special_tokens=False))


def sse_named_events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Responses stream, asserting the framing: `event: <type>` then its data,
    a blank line after each, no [DONE]."""
    assert b"[DONE]" not in raw
    blocks = raw.split(b"\n\n")
    assert blocks[-1] == b""
    events = []
    for block in blocks[:-1]:
        head, data = block.split(b"\n")
        payload = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + payload["type"].encode()
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# --------------------------------------------------------------------------- the fake model


async def test_a_response_holds_the_reference_text(oai, engine):
    response = await oai.responses.create(
        model=engine.model_name, input="Hello, world!", max_output_tokens=6
    )
    prompt = chat_prompt_ids([{"role": "user", "content": "Hello, world!"}])
    ids, text = expected_output(prompt, 6)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == text
    (item,) = response.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    # The fake model never stops by itself: the limit ends it.
    assert response.status == "incomplete" and item.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(prompt), len(ids))
    assert response.usage.total_tokens == len(prompt) + len(ids)
    assert response.max_output_tokens == 6 and response.tools == [] and response.error is None
    assert_pool_free(engine)


async def test_a_streamed_response_tells_the_same_text_in_order(oai, engine):
    kwargs: dict[str, Any] = {
        "model": engine.model_name,
        "input": "Hi there",
        "max_output_tokens": 7,
    }
    whole = await oai.responses.create(**kwargs)
    events = [event async for event in await oai.responses.create(**kwargs, stream=True)]
    kinds = [event.type for event in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []  # type: ignore[union-attr]
    text = "".join(d.delta for d in deltas)  # type: ignore[union-attr]
    assert text == whole.output_text
    final_response = final.response  # type: ignore[union-attr]
    assert final_response.output_text == text and final_response.id == created.response.id  # type: ignore[union-attr]
    item_id = events[2].item.id  # type: ignore[union-attr]
    assert {d.item_id for d in deltas} == {item_id}  # type: ignore[union-attr]
    assert final_response.usage.output_tokens == 7
    assert_pool_free(engine)


async def test_stream_framing_names_each_event_and_sends_no_done(client):
    body = {"input": "Hi", "max_output_tokens": 3, "stream": True}
    response, raw = await post(client, "/v1/responses", body)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_named_events(raw)
    assert events[-1]["type"] == "response.incomplete"
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert done[0]["text"] == events[-1]["response"]["output"][0]["content"][0]["text"]


async def test_instructions_and_call_items_reach_the_template(client, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATE)
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "-3 C"},
            {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": "none",
        "max_output_tokens": 1,
    }  # fmt: skip
    response, raw = await post(client, "/v1/responses", body)
    expected = (
        "system:Be brief.;user:Weather in Oslo?;assistant:Let me look.<c1 get_weather Oslo>;"
        "tool:-3 C#c1;developer:Answer now.;"
    )
    assert response.status == 200, raw
    assert orjson.loads(raw)["usage"]["input_tokens"] == tokens_of(expected)


async def test_previous_response_id_continues_and_stored_responses_can_be_read_and_deleted(
    oai, engine, monkeypatch
):
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATE)
    first = await oai.responses.create(
        model=engine.model_name, instructions="Sys.", input="One", max_output_tokens=3
    )
    second = await oai.responses.create(
        model=engine.model_name,
        input=[{"role": "user", "content": "Two"}],
        previous_response_id=first.id,
        max_output_tokens=2,
    )
    # The earlier instructions are not carried over; its input and output are.
    expected = f"user:One;assistant:{first.output_text};user:Two;"
    assert second.usage is not None and second.usage.input_tokens == tokens_of(expected)
    assert second.previous_response_id == first.id
    assert (await oai.responses.retrieve(first.id)).model_dump() == first.model_dump()
    third = await oai.responses.create(
        model=engine.model_name, input="Three", previous_response_id=second.id, max_output_tokens=1
    )
    expected += f"assistant:{second.output_text};user:Three;"
    assert third.usage is not None and third.usage.input_tokens == tokens_of(expected)
    await oai.responses.delete(first.id)
    for call in (
        oai.responses.retrieve(first.id),
        oai.responses.delete(first.id),
        oai.responses.create(model=engine.model_name, input="x", previous_response_id=first.id),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            await call
        assert first.id in info.value.message
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = await oai.responses.create(
        model=engine.model_name, input="x", store=False, max_output_tokens=1
    )
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(unstored.id)


async def test_input_items_list_the_conversation_before_the_output_page_by_page(oai, live, engine):
    first = await oai.responses.create(
        model=engine.model_name, instructions="Sys.", input="One", max_output_tokens=2
    )
    turn = [
        {"type": "message", "role": "user", "content": "Two", "id": "msg_mine"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Half"}]},
    ]
    second = await oai.responses.create(
        model=engine.model_name, input=turn, previous_response_id=first.id, max_output_tokens=2
    )
    newest_first = (await oai.responses.input_items.list(second.id)).data
    roles = [(item.type, getattr(item, "role", None)) for item in newest_first]
    assert roles == [("message", "assistant"), ("message", "user")] * 2  # no instructions
    texts = [item.content[0].text for item in newest_first]  # type: ignore[union-attr]
    assert texts == ["Half", "Two", first.output_text, "One"]
    assert newest_first[1].id == "msg_mine" and newest_first[2].id == first.output[0].id
    assert newest_first[0].content[0].type == "output_text"  # type: ignore[union-attr]
    # The client follows the cursor one item at a time; ids stay the same between calls.
    oldest_first = [
        item async for item in oai.responses.input_items.list(second.id, limit=1, order="asc")
    ]
    assert [item.id for item in oldest_first] == [item.id for item in reversed(newest_first)]
    url = f"{live.url}/v1/responses/{second.id}/input_items"
    async with aiohttp.ClientSession() as session:
        async with session.get(url, params={"limit": "2", "after": "msg_mine"}) as response:
            page = await response.json()
        assert [item["id"] for item in page["data"]] == [item.id for item in newest_first[2:]]
        assert page["has_more"] is False and page["last_id"] == newest_first[3].id
        for params, param in (
            ({"limit": "0"}, "limit"),
            ({"limit": "x"}, "limit"),
            ({"limit": "1" * 4301}, "limit"),  # past int()'s digit limit: was a 500
            ({"limit": "٣"}, "limit"),
            ({"order": "up"}, "order"),
            ({"after": "msg_none"}, "after"),
            ({"include": "file_search_call.results"}, "include"),
        ):
            async with session.get(url, params=params) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == param
    first_items = await oai.responses.input_items.list(first.id)
    assert [item.id for item in first_items.data] == [newest_first[3].id]
    # An item the previous response already holds, sent again with its id: a 400 (ids name
    # items; a cursor on a doubled id would page for ever).
    again = {"type": "message", "role": "user", "content": "One", "id": newest_first[3].id}
    with pytest.raises(openai.BadRequestError, match="Duplicate item"):
        await oai.responses.create(
            model=engine.model_name, input=[again], previous_response_id=second.id
        )
    with pytest.raises(openai.NotFoundError):
        await oai.responses.input_items.list("resp_none")


async def test_a_stored_function_call_is_continued_with_its_output(oai, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATE)
    first = await oai.responses.create(
        model=engine.model_name,
        input="Weather?",
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=3,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}
    second = await oai.responses.create(
        model=engine.model_name,
        input=[output],  # type: ignore[list-item]
        previous_response_id=first.id,
        max_output_tokens=1,
    )
    # The fake model's arguments are no JSON object: the template finds no city in them.
    expected = f"user:Weather?;assistant:<{call.call_id} get_weather >;tool:-3 C#{call.call_id};"
    assert second.usage is not None and second.usage.input_tokens == tokens_of(expected)


async def test_a_streamed_response_is_stored_too(oai, engine):
    stream = await oai.responses.create(
        model=engine.model_name, input="Hi", max_output_tokens=2, stream=True
    )
    final = [event async for event in stream][-1]
    stored = await oai.responses.retrieve(final.response.id)  # type: ignore[union-attr]
    assert stored.model_dump() == final.response.model_dump()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content", "input_image"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "input", "'web_search_call'"),
        ({"input": []}, "input", "at least one"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "a message"),
        ({"input": [{"type": "reasoning", "summary": []}] * MAX_INPUT_ITEMS + ["Hi"]}, "input",
         f"at most {MAX_INPUT_ITEMS} items"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"reasoning": {"effort": "bogus"}}, "reasoning.effort", "'minimal'"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "web_search"}}, "tool_choice",
         "not supported"),
        ({"tools": [WEATHER_TOOL]}, "tool_choice", "--tool-call-parser"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice", "not among the tools"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required",
          "text": {"format": {"type": "json_object"}}}, "tool_choice", "cannot both"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
         "text.format", "text.format is invalid"),
        ({"background": True, "store": False}, "background", "must be stored"),
        ({"include": ["file_search_call.results"]}, "include", "not supported"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than"),
        ({"temperature": -1.0}, "temperature", "temperature"),
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"input": "word " * 200}, "input", "context"),
        ({"model": "other"}, "model", "does not exist"),
    ],
)  # fmt: skip
async def test_requests_that_cannot_be_served_are_400s_naming_the_field(
    client, engine, body, param, fragment
):
    response, raw = await post(client, "/v1/responses", {"input": "Hi", **body})
    error = error_of(raw, response.status)
    assert response.status == (404 if param == "model" else 400), error
    assert error["param"] == param and fragment in error["message"], error
    assert_pool_free(engine)


async def test_a_stored_response_holds_no_more_than_the_store_counts(client):
    """Kept as pydantic models and listed dicts, 100,000 reasoning items of 38 bytes held
    84-89 MiB a response, counted as 7.6 MB (twice the body): the store's 256 MiB bound was
    about 3 GB. A stored response is kept as JSON bytes now, and counted as what it holds."""
    items = [{"type": "reasoning", "summary": []}] * 5_000
    body = {"input": [*items, {"role": "user", "content": "Hi"}], "max_output_tokens": 2}
    store = client.server.app[RESPONSES].store
    await post(client, "/v1/responses", body)  # first: whatever is built once is built
    gc.collect()
    tracemalloc.start()
    try:
        response, raw = await post(client, "/v1/responses", body)
        del response
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - len(raw)
    finally:
        tracemalloc.stop()
    stored = store.get(orjson.loads(raw)["id"])
    assert stored is not None and held <= 1.5 * stored.size, (held, stored.size)
    # Read back, listed and continued from its bytes.
    listed = await client.get(f"/v1/responses/{stored.response_id}/input_items?limit=100")
    data = (await listed.json())["data"]
    assert len(data) == 100 and data[0]["type"] == "message" and data[1]["type"] == "reasoning"
    again = {"input": "More", "previous_response_id": stored.response_id, "max_output_tokens": 2}
    response, raw = await post(client, "/v1/responses", again)
    assert response.status == 200, raw
    continued = store.get(orjson.loads(raw)["id"])
    # The items, "Hi", its answer, "More" and its answer.
    assert continued is not None and len(continued.conversation()) == len(items) + 4


@pytest.mark.parametrize("tools", [None, []])
async def test_tool_choice_auto_without_tools_is_the_default(client, tools):
    body = {"input": "Hi", "max_output_tokens": 2, "tool_choice": "auto", "tools": tools}
    response, raw = await post(client, "/v1/responses", body)
    assert response.status == 200, raw
    assert orjson.loads(raw)["tool_choice"] == "auto"


async def test_the_responses_routes_need_a_key_when_keys_are_set(aiohttp_client, engine):
    client = await aiohttp_client(create_app(engine, ServerConfig(api_key=API_KEYS)))
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                         ("DELETE", "/v1/responses/resp_1")):  # fmt: skip
        response = await client.request(method, path, json={"input": "Hi"})
        assert error_of(await response.read(), 401)["type"] == "AuthenticationError"
    headers = {"Authorization": f"Bearer {API_KEYS[1]}"}
    response = await client.post(
        "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=headers
    )
    assert response.status == 200
    # A stored response is its key's: another key neither reads, continues nor deletes it.
    response_id = (await response.json())["id"]
    other = {"Authorization": f"Bearer {API_KEYS[0]}"}
    path = f"/v1/responses/{response_id}"
    assert (await client.get(path, headers=other)).status == 404
    assert (await client.delete(path, headers=other)).status == 404
    body = {"input": "More", "previous_response_id": response_id, "max_output_tokens": 2}
    assert (await client.post("/v1/responses", json=body, headers=other)).status == 404
    assert (await client.post("/v1/responses", json=body, headers=headers)).status == 200
    assert (await client.get(path, headers=headers)).status == 200


async def test_the_openapi_document_has_the_responses_routes(client):
    paths = (await (await client.get("/openapi.json")).json())["paths"]
    assert "text/event-stream" in paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert set(paths["/v1/responses/{response_id}/cancel"]) == {"post"}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_frees_its_blocks(live_factory, stream):
    body = {"input": "Hi", "max_output_tokens": 100, "stream": stream}
    marker = b"event: response.output_text.delta" if stream else None
    await check_a_leaving_client_frees_its_blocks(live_factory, "/v1/responses", body, marker)


async def test_an_engine_failure_mid_stream_is_an_error_event(aiohttp_client):
    engine = await build_engine(step_delay=0.02, fail_at_step=3)
    try:
        client = await aiohttp_client(create_app(engine))
        body = {"input": "Hi", "max_output_tokens": 20, "stream": True}
        response, raw = await post(client, "/v1/responses", body)
        assert response.status == 200
        events = sse_named_events(raw)
        assert events[0]["type"] == "response.created"
        last = events[-1]
        assert last["type"] == "error" and last["code"] == "server_error"
        assert "device lost" in last["message"]
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------- a tiny real model


async def test_the_text_is_what_chat_completions_give(real_oai, real_engine):
    oai, _ = real_oai
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = await oai.chat.completions.create(
        model=real_engine.model_name,
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    response = await oai.responses.create(
        model=real_engine.model_name,
        instructions="Be brief.",
        input="Hi!",
        max_output_tokens=12,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_json_schema_format_gives_json_that_follows_it(real_oai, real_engine, stream):
    oai, _ = real_oai
    kwargs: dict[str, Any] = {
        "model": real_engine.model_name,
        "input": "A city?",
        "text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}},
        "max_output_tokens": 60,
        "temperature": 0,
    }
    if stream:
        events = [e async for e in await oai.responses.create(**kwargs, stream=True)]
        response = events[-1].response  # type: ignore[union-attr]
    else:
        response = await oai.responses.create(**kwargs)
    value = json.loads(response.output_text)
    assert value["city"] in ("Paris", "Oslo") and isinstance(value["n"], int)
    assert response.status == "completed"
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]
    assert_pool_free(real_engine)


class City(BaseModel):
    city: Literal["Paris", "Oslo"]
    n: int


async def test_the_client_s_stream_helper_parses_the_output(real_oai, real_engine):
    oai, _ = real_oai
    async with oai.responses.stream(
        model=real_engine.model_name,
        input="A city?",
        text_format=City,
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert isinstance(final.output_parsed, City)
    assert final.output_text == "".join(deltas) and final.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
async def test_forced_tool_choice_gives_function_call_items(
    real_oai, real_engine, stream, tool_choice
):
    oai, _ = real_oai
    kwargs: dict[str, Any] = {
        "model": real_engine.model_name,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_output_tokens": 80,
        "temperature": 0,
    }
    arguments = ""
    if stream:
        events = [e async for e in await oai.responses.create(**kwargs, stream=True)]
        response = events[-1].response  # type: ignore[union-attr]
        arguments = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments == arguments
    else:
        response = await oai.responses.create(**kwargs)
    assert response.status == "completed" and response.output_text == ""
    (call,) = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")  # type: ignore[union-attr]
    assert call.name in ("get_weather", "get_time")
    if stream:
        assert call.arguments == arguments
    if call.name == "get_weather":
        _check_weather(call.arguments)
    else:
        assert isinstance(json.loads(call.arguments), dict)
    assert_pool_free(real_engine)
