"""response_format, structured_outputs, allowed_token_ids, bad_words and truncate_prompt_tokens
over HTTP, with the official client, on a tiny random Llama (the fake runner of the other
server tests ignores what the sampler is told)."""

from __future__ import annotations

import json
from typing import Any, Literal

import orjson
import pydantic
import pytest

from tests.core.test_sampling_params import an_object, nested_schema, ranged_schema
from tests.server.conftest import assert_pool_free
from tests.support.tokenizers import make_tokenizer

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Alan", "Grace"]},
        "age": {"type": "integer"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: Literal["Ada", "Alan", "Grace"]
    retired: bool


async def test_json_schema_and_json_object_through_the_openai_client(real_oai, real_engine):
    oai, _ = real_oai
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    reply = await oai.chat.completions.create(
        model=real_engine.model_name,
        messages=MESSAGES,
        response_format=response_format,  # type: ignore[arg-type]
        max_tokens=60,
        n=3,
        temperature=1.0,
        seed=5,
    )
    finished = [c for c in reply.choices if c.finish_reason == "stop"]
    assert finished
    for choice in finished:
        value = json.loads(choice.message.content or "")
        assert value["name"] in ("Ada", "Alan", "Grace") and isinstance(value["age"], int)
    # The client's own helper: a pydantic model in, a parsed instance out.
    parsed = await oai.chat.completions.parse(
        model=real_engine.model_name,
        messages=MESSAGES,
        response_format=Person,
        max_tokens=60,
        temperature=0,
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.name in ("Ada", "Alan", "Grace")
    # Streamed, the deltas add up to one JSON object.
    stream = await oai.chat.completions.create(
        model=real_engine.model_name,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    text, reasons = "", []
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    if "stop" in reasons:
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    assert_pool_free(real_engine)


async def test_vllm_extras_choice_allowed_bad_words_truncation(real_oai, real_engine):
    oai, _ = real_oai
    model = real_engine.model_name
    choices = ["red", "green", "blue"]
    reply = await oai.completions.create(
        model=model,
        prompt="Pick a colour:",
        max_tokens=10,
        n=4,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert {c.text for c in reply.choices} <= set(choices)
    allowed = [100, 101, 102]
    reply = await oai.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=8,
        temperature=1.0,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    tokenizer = make_tokenizer()
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and len(logprobs.tokens) == 8
    assert set(logprobs.tokens) <= {tokenizer.decode([t]) for t in allowed}
    prompt = list(range(10, 60))
    greedy: dict[str, Any] = {"model": model, "max_tokens": 3, "temperature": 0}
    reply = await oai.completions.create(
        prompt=prompt, extra_body={"truncate_prompt_tokens": 7}, **greedy
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == 7
    same = await oai.completions.create(prompt=prompt[-7:], **greedy)
    assert reply.choices[0].text == same.choices[0].text
    greedy.update(max_tokens=8, logprobs=0, extra_body={"ignore_eos": True})
    plain = await oai.completions.create(prompt=prompt, **greedy)
    assert plain.choices[0].logprobs is not None
    tokens = plain.choices[0].logprobs.tokens or []
    word = next(
        t for t in tokens if len(tokenizer.encode(t.lstrip(), add_special_tokens=False)) < 2
    )
    greedy["extra_body"] = {"ignore_eos": True, "bad_words": [word]}
    banned = await oai.completions.create(prompt=prompt, **greedy)
    assert banned.choices[0].logprobs is not None
    kept = banned.choices[0].logprobs.tokens or []
    assert len(kept) == 8 and word.lstrip() not in {t.lstrip() for t in kept}
    assert_pool_free(real_engine)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format",
            "response_format.json_schema.schema is invalid",
        ),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs", "regex is invalid"),
        # Nesting that overflowed xgrammar's stack (the server died) as a schema's pattern.
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "pattern": "(" * 30000 + "a" + ")" * 30000},
                    },
                }
            },
            "response_format",
            "nests more than 200",
        ),
        # Keywords the grammar would drop: refused rather than broken by the output.
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "integer", "multipleOf": 7, "maximum": 100},
                    },
                }
            },
            "response_format",
            "uses multipleOf (enforced on integers only",
        ),
        (
            {"structured_outputs": {"json": '{"type": "number", "multipleOf": 0.5}'}},
            "structured_outputs",
            "multipleOf",
        ),
        (
            {"structured_outputs": {"json": {"$defs": {"X": {"$anchor": "x"}}, "$ref": "#x"}}},
            "structured_outputs",
            "$ref to anything but a path",
        ),
        (
            {"structured_outputs": {"json": {"type": "string", "pattern": "^a*$", "minLength": 9}}},
            "structured_outputs",
            "minLength or maxLength together with a pattern",
        ),
        (
            {
                "structured_outputs": {
                    "json": {
                        "type": "object",
                        "properties": {"a": {"type": "array", "items": {"not": {"const": 1}}}},
                    }
                }
            },
            "structured_outputs",
            "uses not",
        ),
        (
            {"structured_outputs": {"json": {"allOf": [{"type": "object"}, {"required": ["a"]}]}}},
            "structured_outputs",
            "allOf",
        ),
        (
            {"structured_outputs": {"json": {"$ref": "https://example.com/s.json"}}},
            "structured_outputs",
            "$ref to anything but a path in this document",
        ),
        ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "no output"),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": [3]},
            "structured_outputs",
            "no output among allowed_token_ids",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        # Bounded: compile times grow faster than the text (a 1M-character regex took > 120 s)
        ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs", "at most 65536"),
        ({"structured_outputs": {"choice": ["a"] * 1025}}, "structured_outputs", "at most 1024"),
        # A schema sent as JSON text nests no deeper than a body may (400 levels: 4.7 s to
        # compile; 3000: a RecursionError, once a 500)
        (
            {"structured_outputs": {"json": json.dumps(nested_schema(400))}},
            "structured_outputs",
            "nests more than 64 levels",
        ),
        (
            {"structured_outputs": {"json": "[" * 3000 + "]" * 3000}},
            "structured_outputs",
            "nests more than 64 levels",
        ),
        # Numeric bounds are spelt out digit by digit: 64 KiB of them took 7-87 s to compile
        (
            {"structured_outputs": {"json": ranged_schema(300)}},
            "structured_outputs",
            "has 600 numeric bounds",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"prefixItems": [{"minimum": 1e308}] * 7},
                    },
                }
            },
            "response_format",
            "response_format.json_schema.schema's numeric bounds have 2163 digits",
        ),
        # Objects of optional or additional properties: 64 KiB of them took up to 236 s
        (
            {"structured_outputs": {"json": an_object(400)}},
            "structured_outputs",
            "has 400 optional properties",
        ),
        # vLLM's switches reach the same checks as offline (they were dropped unread)
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": " ?"}},
            "structured_outputs",
            "whitespace_pattern is not supported",
        ),
        (
            {"structured_outputs": {"choice": ["a"], "disable_fallback": "yes"}},
            "structured_outputs.disable_fallback",
            "valid boolean",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "cannot both",
        ),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids", "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
        ({"truncate_prompt_tokens": 500}, "truncate_prompt_tokens", "<= 128"),
        ({"bad_words": ["  "]}, "bad_words", "empty"),
    ],
)
async def test_bad_constraints_are_a_400_naming_the_field(
    real_oai, real_engine, body, param, fragment
):
    _, server = real_oai
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for path, base in (
            ("/v1/chat/completions", {"messages": MESSAGES}),
            ("/v1/completions", {"prompt": "Hi"}),
        ):
            async with session.post(f"{server.url}{path}", json={**base, **body}) as response:
                error = orjson.loads(await response.read())["error"]
                assert response.status == 400, error
                assert error["param"] == param and fragment in error["message"], error
    assert_pool_free(real_engine)


async def test_constraints_are_built_once_and_off_the_event_loop(
    real_oai, real_engine, monkeypatch
):
    """A grammar compile or thousands of bad words to tokenize would stall every stream."""
    import threading

    oai, _ = real_oai
    prepare = real_engine.constraints.prepare
    threads: list[str] = []

    def recording(params):
        threads.append(threading.current_thread().name)
        return prepare(params)

    monkeypatch.setattr(real_engine.constraints, "prepare", recording)
    from aioinfer.core.constraints import GrammarState

    fill = GrammarState.next_mask
    fills: set[str] = set()

    def recording_fill(self):
        fills.add(threading.current_thread().name)
        return fill(self)

    # A grammar's mask (up to a millisecond a sequence for counted repeats) is filled on the
    # runner thread, not the event loop.
    monkeypatch.setattr(GrammarState, "next_mask", recording_fill)
    await oai.chat.completions.create(
        model=real_engine.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=5,
        n=2,
    )
    await oai.completions.create(
        model=real_engine.model_name,
        prompt=["a", "b"],
        max_tokens=5,
        extra_body={"bad_words": ["the"] * 100},
    )
    assert len(threads) == 2 and threading.main_thread().name not in threads
    # on their own threads: large compiles do not hold up the loop's default pool
    assert all(name.startswith("aioinfer-grammar") for name in threads), threads
    assert fills and threading.main_thread().name not in fills


async def test_keyword_names_as_data_are_not_keywords(real_oai, real_engine):
    """A property named like an unenforced keyword, and such words in enum values, compile;
    so do what the grammar does enforce (an integer's multipleOf between two bounds, a $ref
    into $defs) and a set field's uniqueItems, which pydantic writes (not enforced)."""
    client, _ = real_oai
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "integer", "minimum": 0, "maximum": 9, "multipleOf": 3},
            "if": {"$ref": "#/$defs/Word"},
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b"]},
                "uniqueItems": True,
                "maxItems": 2,
            },
        },
        "required": ["not", "if"],
        "additionalProperties": False,
        "$defs": {"Word": {"enum": ["multipleOf", "allOf"]}},
    }
    out = await client.completions.create(
        model=real_engine.model_name,
        prompt="A JSON object:",
        max_tokens=110,
        temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )
    assert out.choices[0].finish_reason == "stop"
    value = orjson.loads(out.choices[0].text)
    assert value["not"] in (0, 3, 6, 9) and value["if"] in ("multipleOf", "allOf")


async def test_compiles_are_bounded_and_dropped_when_their_clients_leave(
    real_oai, real_engine, monkeypatch
):
    """Compiles wait for threads of their own: past max_waiting a fast 503 with Retry-After,
    and a compile whose client left while it waited is dropped at once (not compiled for
    nobody while the next client waits: deep schemas once held both threads for minutes)."""
    import asyncio
    import threading
    import time

    import aiohttp

    from aioinfer.server.serving import generation
    from aioinfer.server.serving.prompts import WorkQueue
    from tests.server.test_disconnect import raw_request, wait_until

    queue = WorkQueue("structured-output specs to compile", "grammar", threads=1, max_waiting=2)
    monkeypatch.setattr(generation, "COMPILES", queue)
    gate = threading.Event()
    prepare = real_engine.constraints.prepare
    compiled: list[str] = []

    def held(params):
        spec = params.structured_outputs
        if spec is not None and spec.regex is not None:
            compiled.append(spec.regex)
            gate.wait(30)
        return prepare(params)

    monkeypatch.setattr(real_engine.constraints, "prepare", held)
    _, server = real_oai

    def body(regex: str) -> dict:
        return {"prompt": "Hi", "max_tokens": 1, "structured_outputs": {"regex": regex}}

    try:
        first = await raw_request(server, "/v1/completions", body("a"))
        await wait_until(lambda: compiled == ["a"])
        waiting = [await raw_request(server, "/v1/completions", body(r)) for r in "bc"]
        await wait_until(lambda: queue.in_flight == 3)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/v1/completions", json=body("d")) as response:
                error = orjson.loads(await response.read())["error"]
                assert response.status == 503 and response.headers["Retry-After"] == "1"
                assert "3 structured-output specs to compile" in error["message"]
            for _, writer in waiting:
                writer.close()
            await wait_until(lambda: queue.in_flight == 1, timeout=1.0)
            gate.set()
            reader, writer = first
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n"), 30)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200"), answer
            assert compiled == ["a"]  # the others never compiled
            start = time.monotonic()
            json_object = {
                "prompt": "Hi",
                "max_tokens": 1,
                "response_format": {"type": "json_object"},
            }
            async with session.post(f"{server.url}/v1/completions", json=json_object) as response:
                assert response.status == 200
            assert time.monotonic() - start < 1.0
    finally:
        gate.set()
    await wait_until(lambda: queue.in_flight == 0 and real_engine.num_unfinished == 0)
    assert_pool_free(real_engine)
