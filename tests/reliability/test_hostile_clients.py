"""Clients that send what no SDK would: header bytes that are not UTF-8, token ids outside the
vocabulary with echo, bodies without a length that run past the limit, megabytes of tools
behind a short message, a chat template of their own that loops or allocates. Each gets its
4xx; the server and the pool are unharmed, and the event loop answers /health meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import http.client
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from aioinfer.server.http import bodies
from aioinfer.server.http.bodies import body_limit
from aioinfer.server.serving.generation import MAX_PROMPT_LOGPROB_ENTRIES
from aioinfer.server.serving.protocol import MAX_CHAT_MESSAGES
from tests.reliability.conftest import ThreadedServer
from tests.server.conftest import assert_pool_free, build_engine
from tests.support.health_poller import HealthPoller
from tests.support.tokenizers import make_tokenizer

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


# ------------------------------------------------------------------ the loop under attack

# As the templates of Qwen, Llama 3.x, Hermes and Mistral do, this one writes the tools.
TOOLS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
)
MAX_HEALTH_WAIT = 0.5  # seconds: what no request may make /health wait
MiB = 1 << 20


@pytest.fixture(scope="module")
def exposed() -> Iterator[ThreadedServer]:
    """The real app on a loop of its own (so that a stall shows in a /health poller on another
    thread), trusting request templates, its model's template writing the tools."""
    tokenizer = copy.deepcopy(make_tokenizer())  # the shared one stays as it is
    tokenizer.chat_template = TOOLS_TEMPLATE
    server = ThreadedServer(
        ServerConfig(trust_request_chat_template=True), tokenizer=tokenizer
    ).start()
    yield server
    server.stop()


def post_json(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        payload = orjson.dumps(body)
        conn.request("POST", path, payload, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        conn.close()


def attacked(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    """The answer to `body`, and the longest a /health poller waited while it ran."""
    with HealthPoller(url) as poller:
        time.sleep(0.1)  # a poll or two before
        status, reply = post_json(url, path, body)
        time.sleep(0.1)
    assert len(poller.answers) >= 3 and set(poller.answers) == {200}
    return status, reply, poller.worst


def test_megabytes_of_tools_behind_a_short_message_never_stall_the_loop(exposed):
    """20,000 tools and "hi" once rendered and tokenized on the loop (33 s for 16.5 MB), as the
    message was short; then a 400 for the prompt's length. Now the tools are measured off the
    loop, before anything is rendered."""
    tool = {"type": "object", "properties": {}}
    tools = [
        {
            "type": "function",
            "function": {"name": f"f{i}", "description": "d" * 700, "parameters": tool},
        }
        for i in range(6000)  # 4.6 MB
    ]
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
        "tool_choice": "none",
        "max_tokens": 1,
    }
    status, reply, worst = attacked(exposed.url, "/v1/chat/completions", body)
    assert worst < MAX_HEALTH_WAIT
    assert status == 400 and reply["error"]["param"] == "tools", reply


def test_a_request_template_that_loops_or_allocates_never_stalls_the_loop(exposed):
    """Nested loops (2.2 s on the loop for 8000 x 8000) and 'x' * 2**29 (11 s, and 590 MB kept)
    render in a child process under a budget: 400s naming chat_template."""
    messages = [{"role": "user", "content": "hi"}]
    before = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
    for template, fragment in (
        ("{% for a in range(8000) %}{% for b in range(8000) %}{% endfor %}{% endfor %}", "CPU"),
        ("{% set s = 'x' * 536870912 %}{{ s|length }}{{ messages[0]['content'] }}", "memory"),
    ):
        body = {"messages": messages, "chat_template": template, "max_tokens": 1}
        status, reply, worst = attacked(exposed.url, "/v1/chat/completions", body)
        assert worst < MAX_HEALTH_WAIT, template
        assert status == 400 and reply["error"]["param"] == "chat_template", reply
        assert fragment in reply["error"]["message"]
    after = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
    assert after - before < 50 * MiB


async def test_a_body_trickled_past_the_read_timeout_is_a_408(aiohttp_client, engine):
    """A byte every few seconds held a body, its buffer and its connection for as long as the
    client liked: only a gap of 60 s between bytes ended it. --body-read-timeout bounds the
    whole body."""
    client = await aiohttp_client(create_app(engine, ServerConfig(body_read_timeout=0.5)))
    reader, writer = await asyncio.open_connection(client.host, client.port)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 200\r\n\r\n"
    )
    writer.write(head.encode())

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(200):  # 10 s in all, a byte each 50 ms
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.05)

    sending = asyncio.create_task(trickle())
    start = time.monotonic()
    try:
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        answer += await asyncio.wait_for(reader.readuntil(b"}}"), 5)
    finally:
        sending.cancel()
        writer.close()
    assert time.monotonic() - start < 2
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer
    error = orjson.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert "--body-read-timeout" in error["message"] and error["type"] == "RequestTimeoutError"
    response = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
    assert response.status == 200


async def test_prompt_logprobs_past_their_bound_are_a_400_naming_the_field(
    aiohttp_client, engine, monkeypatch
):
    """echo with logprobs 20 made a 1.1 MB answer of a 12.8 KB body (2000 token ids), and a
    16 MiB body of many prompts would have held about 1.4 GB: the prompt logprob entries of
    one request (tokens x (alternatives + 1) x n, echoed ones counted) are bounded, before the
    engine computes any."""
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    added: list[str] = []
    add_request = engine.add_request

    def counted(*args: Any, **kwargs: Any) -> Any:
        added.append(args[2] if len(args) > 2 else kwargs.get("request_id"))
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", counted)
    prompt = [5 + i % 50 for i in range(120)]
    per_prompt = len(prompt) * 21  # logprobs 20: each token and its 20 alternatives
    many = MAX_PROMPT_LOGPROB_ENTRIES // per_prompt + 1
    echoed = {"prompt": [prompt] * many, "echo": True, "logprobs": 20, "max_tokens": 0}
    by_n = {"prompt": prompt, "n": many, "prompt_logprobs": 20}
    chat = {"messages": [{"role": "user", "content": "hi " * 100}], "prompt_logprobs": 20}
    for path, body, param in (
        ("/v1/completions", echoed, "logprobs"),
        ("/v1/completions", by_n, "prompt_logprobs"),
        ("/v1/chat/completions", {**chat, "n": many}, "prompt_logprobs"),
    ):
        response = await client.post(path, json=body)
        error = orjson.loads(await response.read())["error"]
        assert response.status == 400 and error["param"] == param, error
        assert f"at most {MAX_PROMPT_LOGPROB_ENTRIES} prompt logprob entries" in error["message"]
    assert added == []  # refused before the engine saw them
    # Within the bound, the same request is answered.
    response = await client.post("/v1/completions", json={**echoed, "prompt": [prompt] * 2})
    choices = orjson.loads(await response.read())["choices"]
    assert response.status == 200 and len(choices[1]["logprobs"]["top_logprobs"]) == len(prompt)
    assert_pool_free(engine)


async def test_a_kept_alive_connection_holds_nothing_of_its_last_body(aiohttp_client, engine):
    """aiohttp keeps a connection's last request until its next one comes (or the keep-alive
    timeout, 75 s), and the request kept its parsed body: a body of many small items is
    several times its bytes as Python objects, held for every idle connection."""
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    body = orjson.dumps({"prompt": "hi", "ignored": [[1]] * 200_000})  # 1 MB of JSON
    headers = {"Content-Type": "application/json"}
    for path in ("/tokenize", "/v1/completions"):  # the second one is measured
        gc.collect()
        tracemalloc.start()
        try:
            response = await client.post(path, data=body, headers=headers)
            assert response.status == 200
            await response.read()
            del response
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    assert held < 1 << 20, held  # the parsed body alone is about 14 MB


async def test_conversations_of_very_many_messages_are_a_400_naming_the_field(
    aiohttp_client, engine
):
    """A chat of 300,000 empty messages (an 8.7 MB body) was validated into 300,000 models
    (173 MB, 1.7 s) and rendered into a prompt far past any context. A conversation
    holds at most MAX_CHAT_MESSAGES messages: as sent (chat and /tokenize messages, Anthropic
    messages), and as another API's request becomes a chat (Anthropic tool results are a
    message each; Responses instructions and items, with what they continue)."""
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    most = MAX_CHAT_MESSAGES
    empty = [{"role": "user", "content": ""}]
    results = [
        {"type": "tool_result", "tool_use_id": f"c{i}", "content": "ok"} for i in range(most)
    ]
    items = [{"type": "message", "role": "user", "content": "hi"}] * most
    for path, body, param in (
        ("/v1/chat/completions", {"messages": empty * (most + 1)}, "messages"),
        ("/v1/chat/completions", {"messages": empty * 300_000}, "messages"),
        ("/tokenize", {"messages": empty * (most + 1)}, "messages"),
        ("/v1/messages", {"messages": empty * (most + 1), "max_tokens": 1}, "messages"),
        ("/v1/messages/count_tokens", {"messages": empty * (most + 1)}, "messages"),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": [*results, *results]}], "max_tokens": 1},
            "messages",
        ),
        ("/v1/responses", {"input": items, "instructions": "Be brief."}, "input"),
    ):
        response = await client.post(path, json=body)
        answer = orjson.loads(await response.read())
        assert response.status == 400, (path, answer)
        if "error" in answer and "param" in answer["error"]:  # OpenAI's shape
            assert answer["error"]["param"] == param, (path, answer)
        message = answer["error"]["message"]
        assert message.startswith(param) and f"at most {most} " in message, (path, message)
    # Within the bound, a conversation is rendered.
    response = await client.post("/tokenize", json={"messages": empty * most})
    assert response.status == 200 and (await response.json())["count"] > most
    assert_pool_free(engine)
