"""The app through aiohttp's test client: responses against the fake model's reference outputs,
exact SSE framing, every error class, auth and the engine lifecycle (metrics:
http/test_metrics.py)."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from pydantic import TypeAdapter

import aioinfer
from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from aioinfer.server.openai import shapes
from tests.server.conftest import (
    API_KEYS,
    MAX_MODEL_LEN,
    MODEL,
    assert_pool_free,
    build_engine,
    chat_prompt_ids,
    expected_output,
    fake_logprobs,
    text_prompt_ids,
)
from tests.support.tokenizers import make_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello, world! How are you today?"},
]


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body, asserting the exact framing: only `data: ...` events, each ending in a
    blank line, the last one `[DONE]`."""
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event
    payloads = [e.removeprefix(b"data: ") for e in events]
    assert payloads[-1] == b"[DONE]" and b"[DONE]" not in payloads[:-1]
    return payloads[:-1]


def chunks_of(raw: bytes) -> list[dict]:
    out = []
    for payload in sse_events(raw):
        chunk = orjson.loads(payload)
        assert orjson.dumps(chunk) == payload  # compact JSON, nothing else on the line
        out.append(chunk)
    return out


async def post(client, path, body, **kwargs):
    response = await client.post(path, json=body, **kwargs)
    return response, await response.read()


def error_of(raw: bytes, status: int) -> dict:
    body = orjson.loads(raw)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


# --------------------------------------------------------------------------- happy paths


async def test_plain_endpoints(client):
    response = await client.get("/health")
    assert response.status == 200 and await response.read() == b""
    response = await client.get("/version")
    assert await response.json() == {"version": aioinfer.__version__}
    response = await client.get("/v1/models")
    body = await response.json()
    assert body["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [(MODEL, MAX_MODEL_LEN)]
    TypeAdapter(shapes.ModelList).validate_python(body)
    response = await client.get(f"/v1/models/{MODEL}")
    assert (await response.json())["id"] == MODEL
    response = await client.get("/openapi.json")
    assert (await response.json())["openapi"].startswith("3.")


async def test_completion_matches_the_reference(client):
    prompt = "The quick brown fox"
    response, raw = await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 9})
    assert response.status == 200 and response.content_type == "application/json"
    body = orjson.loads(raw)
    TypeAdapter(shapes.CompletionResponse).validate_python(body)
    ids = text_prompt_ids(prompt)
    _, text = expected_output(ids, 9)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 9,
                             "total_tokens": len(ids) + 9}  # fmt: skip


async def test_completion_defaults_to_16_tokens_clamped_to_the_context(client):
    _, raw = await post(client, "/v1/completions", {"prompt": [5, 6, 7]})
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 16
    long_prompt = [5] * (MAX_MODEL_LEN - 4)
    _, raw = await post(client, "/v1/completions", {"prompt": long_prompt})
    body = orjson.loads(raw)
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"


async def test_completion_prompt_forms_and_n(client):
    prompts = [[5, 6, 7], [9, 10]]
    body = {"prompt": prompts, "max_tokens": 4, "n": 2}
    _, raw = await post(client, "/v1/completions", body)
    choices = orjson.loads(raw)["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice in choices:
        assert choice["text"] == expected_output(prompts[choice["index"] // 2], 4)[1]
    texts = ["Hello, world!", "An inference server"]
    _, raw = await post(client, "/v1/completions", {"prompt": texts, "max_tokens": 3})
    got = [c["text"] for c in orjson.loads(raw)["choices"]]
    assert got == [expected_output(text_prompt_ids(t), 3)[1] for t in texts]


async def test_echo_and_logprobs(client):
    prompt = [40, 41, 42]
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2}
    _, raw = await post(client, "/v1/completions", body)
    choice = orjson.loads(raw)["choices"][0]
    out_ids, out_text = expected_output(prompt, 3)
    tok = make_tokenizer()
    prompt_text = tok.decode(prompt)
    assert choice["text"] == prompt_text + out_text
    logprobs = choice["logprobs"]
    all_ids = prompt + out_ids
    assert logprobs["tokens"] == [tok.decode([t]) for t in all_ids]
    expected = [None] + [fake_logprobs(t, 2).logprob for t in all_ids[1:]]
    assert logprobs["token_logprobs"] == pytest.approx(expected)
    assert logprobs["top_logprobs"][0] is None
    for token_id, top in zip(all_ids[1:], logprobs["top_logprobs"][1:], strict=True):
        reference = fake_logprobs(token_id, 2)
        alternatives = {tok.decode([t]): lp for t, lp in reference.top}
        alternatives.setdefault(tok.decode([token_id]), reference.logprob)
        assert top == pytest.approx(alternatives)
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets


async def test_chat_matches_the_reference_and_fills_the_context(client):
    _, raw = await post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6})
    body = orjson.loads(raw)
    TypeAdapter(shapes.ChatCompletionResponse).validate_python(body)
    ids = chat_prompt_ids(MESSAGES)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected_output(ids, 6)[1]}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids)
    # Without a limit, chat may use the rest of the context.
    _, raw = await post(client, "/v1/chat/completions", {"messages": MESSAGES})
    assert orjson.loads(raw)["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(ids)


async def test_stop_strings(client):
    prompt = [12, 13, 14]
    _, full = expected_output(prompt, 24)
    stop = full[6:8]
    cut = full.index(stop)
    for include in (False, True):
        body = {"prompt": prompt, "max_tokens": 24, "stop": [stop],
                "include_stop_str_in_output": include}  # fmt: skip
        _, raw = await post(client, "/v1/completions", body)
        choice = orjson.loads(raw)["choices"][0]
        assert choice["text"] == full[: cut + (len(stop) if include else 0)]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


async def test_stop_token_ids(client):
    prompt = [12, 13, 14]
    out_ids, _ = expected_output(prompt, 10)
    first = out_ids.index(out_ids[3])
    # The stop token's own text is left out of the output unless asked for, as in vLLM.
    for include in (False, True):
        body = {"prompt": prompt, "max_tokens": 10, "stop_token_ids": [out_ids[3]],
                "include_stop_str_in_output": include}  # fmt: skip
        _, raw = await post(client, "/v1/completions", body)
        choice = orjson.loads(raw)["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == out_ids[3]
        end = first + 1 if include else first
        assert choice["text"] == make_tokenizer().decode(out_ids[:end])


# --------------------------------------------------------------------------- streaming


async def test_chat_stream_framing_and_headers(client):
    body = {"messages": MESSAGES, "max_tokens": 5, "stream": True}
    response, raw = await post(client, "/v1/chat/completions", body)
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["X-Accel-Buffering"] == "no"
    chunks = chunks_of(raw)
    for chunk in chunks:
        TypeAdapter(shapes.ChatCompletionChunk).validate_python(chunk)
        assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
        assert chunk["id"] == chunks[0]["id"] and chunk["id"].startswith("chatcmpl-")
    first, *middle, last = (chunk["choices"][0] for chunk in chunks)
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["finish_reason"] is None
    assert all(c["finish_reason"] is None and set(c["delta"]) == {"content"} for c in middle)
    assert last["delta"] == {} and last["finish_reason"] == "length"
    text = "".join(c["delta"]["content"] for c in middle)
    assert text == expected_output(chat_prompt_ids(MESSAGES), 5)[1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_deltas_concatenate_to_the_non_streamed_text(client, path):
    base = {"max_tokens": 12, "n": 2, "seed": 7, "temperature": 0.8}
    base |= {"messages": MESSAGES} if "chat" in path else {"prompt": "Hello, world!"}
    _, raw = await post(client, path, base)
    whole = {c["index"]: c for c in orjson.loads(raw)["choices"]}
    _, raw = await post(client, path, {**base, "stream": True})
    streamed: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for chunk in chunks_of(raw):
        [choice] = chunk["choices"]
        piece = choice.get("text", choice.get("delta", {}).get("content", ""))
        streamed[choice["index"]] += piece
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    for index, choice in whole.items():
        text = choice.get("text", choice.get("message", {}).get("content"))
        assert streamed[index] == text
        assert finish[index] == choice["finish_reason"]


async def test_a_stream_interval_sends_fewer_larger_events_with_the_same_output(aiohttp_client):
    """--stream-interval 4 (vLLM's): the first token at once, then four at a time, the last at
    once; the tokens, the text and the logprobs are those of a non-streamed request."""
    engine = await build_engine(step_delay=0.005, stream_interval=4)
    try:
        client = await aiohttp_client(create_app(engine, ServerConfig()))
        body = {"prompt": "Hello, world!", "max_tokens": 14, "logprobs": 1,
                "return_token_ids": True}  # fmt: skip
        _, raw = await post(client, "/v1/completions", body)
        [whole] = orjson.loads(raw)["choices"]
        _, raw = await post(client, "/v1/completions", {**body, "stream": True})
        choices = [chunk["choices"][0] for chunk in chunks_of(raw)]
        sizes = [len(c["token_ids"]) for c in choices if c.get("token_ids")]
        assert sum(sizes) == 14 and len(sizes) <= 5  # 1 + 4 + 4 + 4 + 1 at most
        assert all(size >= 4 for size in sizes[1:-1])
        assert [i for c in choices for i in c.get("token_ids", [])] == whole["token_ids"]
        assert "".join(c["text"] for c in choices) == whole["text"]
        streamed_logprobs = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert streamed_logprobs == whole["logprobs"]["tokens"]
        assert choices[-1]["finish_reason"] == whole["finish_reason"] == "length"
        assert_pool_free(engine)
    finally:
        await engine.shutdown()


async def test_stream_usage_options(client):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}}  # fmt: skip
    _, raw = await post(client, "/v1/completions", body)
    chunks = chunks_of(raw)
    assert all("usage" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    _, raw = await post(client, "/v1/completions", body)
    chunks = chunks_of(raw)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)


async def test_chat_stream_logprobs(client):
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True, "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    _, raw = await post(client, "/v1/chat/completions", body)
    entries = []
    for chunk in chunks_of(raw):
        logprobs = chunk["choices"][0]["logprobs"]
        if logprobs is not None:
            entries.extend(logprobs["content"])
    out_ids, _ = expected_output(chat_prompt_ids(MESSAGES), 4)
    tok = make_tokenizer()
    assert [e["token"] for e in entries] == [tok.decode([t]) for t in out_ids]
    assert [e["logprob"] for e in entries] == pytest.approx(
        [fake_logprobs(t, 2).logprob for t in out_ids]
    )
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert entries[0]["bytes"] == list(entries[0]["token"].encode())


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprob_bytes_are_a_character_s_pieces(real_oai, real_engine, stream):
    """Tokens that hold pieces of one character decode to U+FFFD each; their `bytes` are their
    own, so that a client can join them (OpenAI's field), streamed or not."""
    client, _ = real_oai
    tok = make_tokenizer()
    ids = tok.encode("\U0001d11e", add_special_tokens=False)  # four tokens of one byte each
    assert len(ids) == 4 and all(tok.decode([i]) == "\ufffd" for i in ids)
    byte_of = dict(zip(ids, "\U0001d11e".encode(), strict=True))
    extra = {"allowed_token_ids": ids, "return_token_ids": True}
    kwargs = dict(
        model=real_engine.model_name,
        messages=MESSAGES,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    if stream:
        entries, token_ids = [], []
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs:
                entries += chunk.choices[0].logprobs.content
            if chunk.choices:
                token_ids += getattr(chunk.choices[0], "token_ids", None) or []
    else:
        reply = await client.chat.completions.create(**kwargs)
        entries = reply.choices[0].logprobs.content
        token_ids = reply.choices[0].token_ids
    assert len(entries) == len(token_ids) == 6
    for entry, token_id in zip(entries, token_ids, strict=True):
        assert entry.token == "\ufffd" and entry.bytes == [byte_of[token_id]]
    # Whole tokens keep their text's bytes.
    assert all(t.bytes == list(t.token.encode()) for e in entries for t in e.top_logprobs
               if "\ufffd" not in t.token)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_text_offsets_stay_those_of_the_text_after_pieces_of_a_character(
    real_oai, real_engine, stream
):
    """An echoed prompt whose character is split over four byte tokens: each token's offset
    is where its text starts in the returned text, before and after the pieces."""
    client, _ = real_oai
    tok = make_tokenizer()
    prompt = "a\U0001d11e b"
    kwargs = dict(model=real_engine.model_name, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    allowed = {"allowed_token_ids": tok.encode("c", add_special_tokens=False)}
    if stream:
        text, tokens, offsets = "", [], []
        async for chunk in await client.completions.create(
            stream=True, extra_body=allowed, **kwargs
        ):
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
                offsets += chunk.choices[0].logprobs.text_offset
    else:
        choice = (await client.completions.create(extra_body=allowed, **kwargs)).choices[0]
        text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    assert text == prompt + "cc" and tokens.count("\ufffd") == 4
    assert offsets[-2:] == [len(prompt), len(prompt) + 1]
    for token, offset in zip(tokens, offsets, strict=True):
        if token != "\ufffd":
            assert text[offset:].startswith(token)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("data", "headers", "fragment"),
    [
        (b"{", {"Content-Type": "application/json"}, "not valid JSON"),
        (b"", {"Content-Type": "application/json"}, "not valid JSON"),
        (b"[1, 2]", {"Content-Type": "application/json"}, "must be a JSON object, got an array"),
        (b'"x"', {"Content-Type": "application/json"}, "must be a JSON object, got a string"),
        (b"null", {"Content-Type": "application/json"}, "must be a JSON object, got null"),
        (b"5", {"Content-Type": "application/json"}, "must be a JSON object, got a number"),
        (b'{"prompt": "a", "temperature": NaN}', {"Content-Type": "application/json"}, "JSON"),
        (b'{"prompt": "a", "top_p": Infinity}', {"Content-Type": "application/json"}, "JSON"),
        (b'{"prompt": "\xff\xfe"}', {"Content-Type": "application/json"}, "UTF-8"),
        (b'{"prompt": "\\ud800"}', {"Content-Type": "application/json"}, "surrogate"),
        (b'{"prompt": "a"}', {"Content-Type": "text/plain"}, "Unsupported Media Type"),
        (b'{"prompt": "a"}', {}, "Unsupported Media Type"),
        (b'{"prompt": "a"}', {"Content-Type": "application/json; charset=latin-1"}, "UTF-8"),
        (  # not gzip at all
            b'{"prompt": "a"}',
            {"Content-Type": "application/json", "Content-Encoding": "gzip"},
            "could not be read",
        ),
        (
            b'{"prompt": "a"}',
            {"Content-Type": "application/json", "Content-Encoding": "deflate"},
            "could not be read",
        ),
    ],
)
async def test_malformed_bodies_are_400(client, data, headers, fragment):
    response = await client.post("/v1/completions", data=data, headers=headers)
    error = error_of(await response.read(), 400)
    assert response.status == 400
    assert error["type"] == "BadRequestError" and fragment in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/completions", {"prompt": "a", "max_tokens": "10"}, "max_tokens", "valid integer"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature", ">= 0"),
        ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix", "not supported"),
        ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of", "best_of"),
        ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
        ("/v1/completions", {"prompt": [5, 4096]}, "prompt", "[0, 4096)"),
        ("/v1/completions", {"prompt": [5], "logprobs": 21}, "logprobs", "<= 20"),
        ("/v1/completions", {"prompt": [5], "logit_bias": {"9999": 1}}, "logit_bias", "vocab"),
        ("/v1/completions", {"prompt": [5] * 120, "max_tokens": 10}, "max_tokens", "130"),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "tools": [{}]},
            "tools[0].type",
            "required",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, "n", ">= 1"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1},
            "top_logprobs",
            ">= 0",
        ),
    ],
)
async def test_invalid_requests_name_the_field(client, engine, path, body, param, fragment):
    _, raw = await post(client, path, body)
    error = error_of(raw, 400)
    assert error["param"] == param and fragment in error["message"]
    assert_pool_free(engine)


async def test_prompt_too_long_names_both_lengths(client):
    _, raw = await post(client, "/v1/completions", {"prompt": [5] * 200})
    error = error_of(raw, 400)
    assert "128" in error["message"] and "200" in error["message"]


async def test_unknown_model_route_and_method(client):
    response, raw = await post(client, "/v1/completions", {"prompt": "a", "model": "gpt-9"})
    error = error_of(raw, 404)
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert "`gpt-9` does not exist" in error["message"] and MODEL in error["message"]
    response = await client.get("/v1/models/gpt-9")
    assert error_of(await response.read(), 404)["param"] == "model"
    response = await client.get("/v1/nothing")
    assert error_of(await response.read(), 404)["type"] == "NotFoundError"
    response = await client.get("/v1/completions")
    error = error_of(await response.read(), 405)
    assert "POST" in response.headers["Allow"] and "GET" in error["message"]


async def test_oversized_bodies_are_413(client):
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    response = await client.post(
        "/v1/completions", data=big, headers={"Content-Type": "application/json"}
    )
    error = error_of(await response.read(), 413)
    assert "limit" in error["message"]

    async def chunked():  # no Content-Length: the size is checked after reading
        yield big

    response = await client.post(
        "/v1/completions", data=chunked(), headers={"Content-Type": "application/json"}
    )
    assert response.status == 413


async def test_overload_is_503_with_retry_after(aiohttp_client):
    engine = await build_engine(step_delay=0.02, max_num_seqs=1, max_queued_requests=1)
    try:
        client = await aiohttp_client(create_app(engine))
        body = {"prompt": [5], "max_tokens": 40, "ignore_eos": True}
        running = asyncio.create_task(client.post("/v1/completions", json=body))
        while engine.scheduler.num_running < 1:
            await asyncio.sleep(0.005)
        waiting = asyncio.create_task(client.post("/v1/completions", json=body))
        while engine.scheduler.num_waiting < 1:
            await asyncio.sleep(0.005)
        response, raw = await post(client, "/v1/completions", body)
        error = error_of(raw, 503)
        assert error["type"] == "ServiceUnavailableError" and response.headers["Retry-After"]
        for task in (running, waiting):
            assert (await task).status == 200
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------- auth


async def test_api_keys(aiohttp_client, engine):
    client = await aiohttp_client(create_app(engine, ServerConfig(api_key=API_KEYS)))
    for path in ("/health", "/ping", "/load", "/metrics", "/version"):
        assert (await client.get(path)).status == 200
    response = await client.post("/invocations", json={"prompt": "a"})
    assert response.status == 401
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {API_KEYS[0]}"},
                    {"Authorization": API_KEYS[0]}):  # fmt: skip
        response = await client.get("/v1/models", headers=headers)
        error = error_of(await response.read(), 401)
        assert error["type"] == "AuthenticationError"
        assert response.headers["WWW-Authenticate"] == "Bearer"
    for key in API_KEYS:
        response = await client.get("/v1/models", headers={"Authorization": f"bearer {key}"})
        assert response.status == 200
    response = await client.post("/v1/completions", json={"prompt": "a"})
    assert response.status == 401


# --------------------------------------------------------------------------- tokenizer endpoints


async def test_tokenize_and_detokenize(client):
    _, raw = await post(client, "/tokenize", {"prompt": "Hello, world!"})
    ids = text_prompt_ids("Hello, world!")
    assert orjson.loads(raw) == {"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN}
    _, raw = await post(client, "/tokenize", {"messages": MESSAGES})
    assert orjson.loads(raw)["tokens"] == chat_prompt_ids(MESSAGES)
    _, raw = await post(client, "/detokenize", {"tokens": ids})
    assert orjson.loads(raw) == {"prompt": "Hello, world!"}
    _, raw = await post(client, "/detokenize", {"tokens": [1, -5]})
    assert error_of(raw, 400)["param"] == "tokens"
    _, raw = await post(client, "/tokenize", {"prompt": "a", "messages": MESSAGES})
    assert error_of(raw, 400)["message"]


async def test_streamed_echo_and_logprobs_equal_the_non_streamed_ones(client):
    body = {"prompt": ["Hello, world!", "An inference"], "max_tokens": 5, "n": 2, "echo": True,
            "logprobs": 1}  # fmt: skip
    _, raw = await post(client, "/v1/completions", body)
    whole = {c["index"]: c for c in orjson.loads(raw)["choices"]}
    _, raw = await post(client, "/v1/completions", {**body, "stream": True})
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    streamed = {i: {"text": "", **{k: [] for k in keys}} for i in whole}
    for chunk in chunks_of(raw):
        [choice] = chunk["choices"]
        into = streamed[choice["index"]]
        into["text"] += choice["text"]
        for key in keys if choice["logprobs"] else ():
            into[key] += choice["logprobs"][key]
    for index, choice in whole.items():
        assert streamed[index]["text"] == choice["text"]
        assert {k: streamed[index][k] for k in keys} == choice["logprobs"]


async def test_json_content_type_with_utf8_charset_is_fine(client):
    response = await client.post(
        "/v1/completions",
        data=b'{"prompt": [5], "max_tokens": 1}',
        headers={"Content-Type": "Application/JSON; charset=UTF-8"},
    )
    assert response.status == 200


async def test_several_served_names_answer_as_the_first(aiohttp_client):
    engine = await build_engine(served_model_name=("first", "second"))
    try:
        client = await aiohttp_client(create_app(engine, ServerConfig()))
        _, raw = await post(
            client, "/v1/completions", {"prompt": [5], "max_tokens": 2, "model": "second"}
        )
        assert orjson.loads(raw)["model"] == "first"
        cards = (await (await client.get("/v1/models")).json())["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("first", None), ("second", None)]
        assert (await client.get("/v1/models/second")).status == 200
        _, raw = await post(client, "/v1/completions", {"prompt": [5], "model": "third"})
        assert "Valid models: first, second" in error_of(raw, 404)["message"]
    finally:
        await engine.shutdown()
