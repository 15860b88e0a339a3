"""The server's guarantees under faults and load, in process over the fake engine: one counted
abort path, admission control before tokenization, queue timeouts, slow consumers, SSE
keep-alive, draining, engine death before the first token, logs without secrets, and model
names that are never opened as paths."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from aioinfer.config import ServerConfig
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app, drain
from aioinfer.server.http.sse import KEEP_ALIVE
from aioinfer.server.openai import completions
from aioinfer.server.serving import chat as serving_chat
from aioinfer.server.serving.generation import MAX_N
from tests.server.conftest import (
    MODEL,
    LiveServer,
    assert_pool_free,
    build_engine,
    expected_output,
)
from tests.server.test_disconnect import raw_request, wait_until

LONG = {"ignore_eos": True}


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """Starts the app over an engine on a live TCP site; stops both afterwards."""
    started: list[tuple[LiveServer, AsyncEngine]] = []

    async def start(engine: AsyncEngine, config: ServerConfig | None = None, **kw: Any):
        server = await LiveServer(create_app(engine, config or ServerConfig(), **kw)).start()
        started.append((server, engine))
        return server

    yield start
    for server, engine in started:
        await server.stop()
        await engine.shutdown()


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any):
    async with session.post(url, json=body, **kw) as response:
        return response.status, dict(response.headers), await response.read()


def data_events(raw: bytes) -> list[bytes]:
    """The data payloads of an SSE body (comments dropped); the last one must be [DONE]."""
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]", events[-3:]
    return [e.removeprefix(b"data: ") for e in events if not e.startswith(b":")]


def stream_choices(raw: bytes) -> dict[int, tuple[str, str | None]]:
    out: dict[int, list[Any]] = {}
    for payload in data_events(raw)[:-1]:
        chunk = orjson.loads(payload)
        for choice in chunk["choices"]:
            entry = out.setdefault(choice["index"], ["", None])
            entry[0] += choice.get("text", "")
            entry[1] = choice["finish_reason"] or entry[1]
    return {i: (t, r) for i, (t, r) in out.items()}


def error_of(raw: bytes, status: int) -> dict[str, Any]:
    error = orjson.loads(raw)["error"]
    assert error["code"] == status
    return error


# --------------------------------------------------------------------------- one abort path


async def test_every_early_end_is_one_idempotent_counted_abort(serve):
    engine = await build_engine(step_delay=0.02)
    server = await serve(engine)
    cases = [  # (path, body, engine requests it makes)
        ("/v1/completions", {"prompt": [5, 6], "n": 3, "stream": True, "max_tokens": 90}, 1),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 90}, 1),
        ("/v1/completions", {"prompt": [[5], [6, 7]], "n": 2, "stream": True, "max_tokens": 90},
         2),
    ]  # fmt: skip
    total = 0
    for path, body, num_requests in cases:
        reader, writer = await raw_request(server, path, {**body, **LONG})
        n = body["n"]
        await wait_until(lambda: engine.scheduler.num_running >= n)  # noqa: B023
        if body.get("stream"):
            await reader.readuntil(b"data: ")  # tokens flow
        writer.close()
        total += num_requests
        await wait_until(lambda: engine.num_unfinished == 0, 2.0)
        # Each API request counts once, however many sequences (n) it had.
        assert engine.stats.aborted_by_reason == {"client_disconnect": total}
        assert_pool_free(engine)
    # Idempotent: a second abort of the same request, or of a finished one, does nothing.
    stream = engine.add_request([5], SamplingParams(max_tokens=50), "direct")
    assert engine.abort("direct", "test") and not engine.abort("direct", "test")
    assert (await stream.get()).outputs[0].finish_reason == "abort"
    assert engine.stats.aborted == total + 1
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/metrics") as r:
        text = await r.text()
    label = f'model_name="{MODEL}",reason="client_disconnect"'
    assert f"aioinfer:request_aborted_total{{{label}}} {float(total)}" in text
    assert f'aioinfer:request_aborted_total{{model_name="{MODEL}",reason="test"}} 1.0' in text


# --------------------------------------------------------------------------- admission control


async def test_a_full_queue_is_a_fast_503_before_any_tokenization(serve, monkeypatch):
    tokenized: Counter[str] = Counter()
    for module, name in ((completions, "encode_prompts"), (serving_chat, "render_chat_off_loop")):
        original = getattr(module, name)

        def counting(*args: Any, _name: str = name, _fn: Any = original) -> Any:
            tokenized[_name] += 1
            return _fn(*args)

        monkeypatch.setattr(module, name, counting)
    engine = await build_engine(step_delay=0.02, max_num_seqs=1, max_queued_requests=2)
    server = await serve(engine)
    url = server.url
    body = {"prompt": "hello world", "max_tokens": 30, **LONG}
    async with aiohttp.ClientSession() as session:
        admitted = [asyncio.create_task(post(session, f"{url}/v1/completions", body))]
        await wait_until(lambda: engine.scheduler.num_running == 1)
        admitted.append(asyncio.create_task(post(session, f"{url}/v1/completions", body)))
        await wait_until(lambda: engine.scheduler.num_waiting == 1)
        # n counts: one waiting plus two sequences would exceed the limit of two.
        status, headers, raw = await post(session, f"{url}/v1/completions", {**body, "n": 2})
        assert status == 503 and headers["Retry-After"] == "1"
        admitted.append(asyncio.create_task(post(session, f"{url}/v1/completions", body)))
        await wait_until(lambda: engine.scheduler.num_waiting == 2)
        before = Counter(tokenized)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for path, refused in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            start = time.monotonic()
            status, headers, raw = await post(session, url + path, refused)
            assert time.monotonic() - start < 0.2
            error = error_of(raw, 503)
            assert status == 503 and headers["Retry-After"] == "1"
            assert (
                error["type"] == "ServiceUnavailableError"
                and "--max-queued-requests" in (error["message"])
            )
        assert tokenized == before  # refused before any tokenization work
        # A request that could never fit is a client error, not a retry.
        status, _, raw = await post(session, f"{url}/v1/completions", {**body, "n": 3})
        assert status == 400 and error_of(raw, 400)["param"] == "n"
        results = await asyncio.gather(*admitted)
        assert [status for status, _, _ in results] == [200, 200, 200]
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
    assert engine.stats.rejected == {"queue_full": 3}
    line = f'aioinfer:request_rejected_total{{model_name="{MODEL}",reason="queue_full"}} 3.0'
    assert line in text
    assert_pool_free(engine)


async def test_too_many_sequences_in_one_request_are_refused_before_tokenizing(serve):
    engine = await build_engine()
    server = await serve(engine)
    async with aiohttp.ClientSession() as session:
        url = f"{server.url}/v1/completions"
        status, _, raw = await post(session, url, {"prompt": "a", "n": 10**9})
        assert status == 400 and error_of(raw, 400)["param"] == "n"
        status, _, raw = await post(session, url, {"prompt": ["a"] * 2000, "n": 3})
        assert status == 400 and error_of(raw, 400)["param"] == "prompt"
        # n has a bound of its own, for chat too (it was only prompts x n <= 4096).
        chat = {"messages": [{"role": "user", "content": "a"}]}
        for path, body in (("/v1/completions", {"prompt": [5]}), ("/v1/chat/completions", chat)):
            status, _, raw = await post(session, server.url + path, {**body, "n": MAX_N + 1})
            error = error_of(raw, 400)
            assert error["param"] == "n" and f"at most {MAX_N}" in error["message"]
    assert_pool_free(engine)


async def test_queued_prompt_tokens_are_bounded_by_max_queued_tokens(serve):
    """--max-queued-tokens bounds the prompt tokens of the waiting sequences (n counts its
    prompt n times), as --max-queued-requests bounds their number: a 503 with Retry-After
    when the queue is full, a 400 naming the prompt for a request that could never fit."""
    engine = await build_engine(step_delay=0.02, max_num_seqs=1, max_queued_tokens=40)
    server = await serve(engine)
    url = server.url
    async with aiohttp.ClientSession() as session:
        blocker = asyncio.create_task(
            post(session, f"{url}/v1/completions", {"prompt": [5], "max_tokens": 30, **LONG})
        )
        await wait_until(lambda: engine.scheduler.num_running == 1)
        waiting = asyncio.create_task(
            post(session, f"{url}/v1/completions", {"prompt": [6] * 20, "max_tokens": 2})
        )
        await wait_until(lambda: engine.scheduler.num_waiting_tokens == 20)
        # 29 tokens, with the chat template.
        chat = {"messages": [{"role": "user", "content": "word " * 5}], "max_tokens": 2}
        for path, body in (
            ("/v1/completions", {"prompt": [7] * 11, "n": 2, "max_tokens": 2}),
            ("/v1/chat/completions", chat),
        ):
            status, headers, raw = await post(session, url + path, body)
            error = error_of(raw, 503)
            assert status == 503 and headers["Retry-After"] == "1", error
            assert "--max-queued-tokens" in error["message"]
        for path, body, param in (
            ("/v1/completions", {"prompt": [7] * 21, "n": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 80}]},
             "messages"),
        ):  # fmt: skip
            status, _, raw = await post(session, url + path, body)
            assert status == 400 and error_of(raw, 400)["param"] == param
        results = await asyncio.gather(blocker, waiting)
        assert [status for status, _, _ in results] == [200, 200]
    assert engine.stats.rejected == {"queue_full": 2}
    assert engine.scheduler.num_waiting_tokens == 0
    assert_pool_free(engine)


async def test_queue_timeout_is_a_503_or_an_in_band_error_once_streaming(serve):
    engine = await build_engine(step_delay=0.02, max_num_seqs=1, queue_timeout=0.2)
    plain = await serve(engine)
    keep_alive = await serve(engine, ServerConfig(sse_keep_alive_interval=0.05))
    long = {"prompt": [5], "max_tokens": 40, **LONG}
    short = {"prompt": [7], "max_tokens": 3}
    async with aiohttp.ClientSession() as session:
        blocker = asyncio.create_task(post(session, f"{plain.url}/v1/completions", long))
        await wait_until(lambda: engine.scheduler.num_running == 1)
        start = time.monotonic()
        json_503, stream_503, in_band = await asyncio.gather(
            post(session, f"{plain.url}/v1/completions", short),
            post(session, f"{plain.url}/v1/completions", {**short, "stream": True}),
            post(session, f"{keep_alive.url}/v1/completions", {**short, "stream": True}),
        )
        assert time.monotonic() - start < 0.6  # the blocker runs for 0.8 s
        for status, headers, raw in (json_503, stream_503):
            error = error_of(raw, 503)
            assert status == 503 and headers["Retry-After"] == "1"
            assert "--queue-timeout" in error["message"]
        status, _, raw = in_band  # the keep-alive comments had started the stream
        assert status == 200 and raw.startswith(KEEP_ALIVE)
        events = data_events(raw)
        assert len(events) == 2 and orjson.loads(events[0])["error"]["code"] == 503
        status, _, raw = await blocker
        assert status == 200
        assert orjson.loads(raw)["choices"][0]["text"] == expected_output([5], 40)[1]
    assert engine.stats.aborted_by_reason == {"queue_timeout": 3}
    assert_pool_free(engine)


async def test_queue_timeout_spares_preempted_and_partly_started_requests():
    # 11 usable blocks of 4 tokens: three requests of 4 + 24 tokens cannot all stay resident.
    engine = await build_engine(step_delay=0.01, num_blocks=12, queue_timeout=0.05)
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12], "c": [13, 14, 15, 16]}
        streams = {rid: engine.add_request(p, params, rid) for rid, p in prompts.items()}
        finals = {}
        for rid, stream in streams.items():
            while not (output := await stream.get()).finished:
                pass
            finals[rid] = output
        assert engine.scheduler.num_preemptions > 0  # some waited again, far beyond 0.05 s
        assert engine.stats.aborted_by_reason == {}
        assert all(f.outputs[0].finish_reason == "length" for f in finals.values())
        # n = 2 with one seat left: the second sequence waits, but its request has started.
        engine2 = await build_engine(step_delay=0.01, max_num_seqs=2, queue_timeout=0.05)
        try:
            engine2.add_request([7], SamplingParams(max_tokens=20), "blocker")
            stream = engine2.add_request([5], SamplingParams(max_tokens=10, n=2), "n2")
            outputs: dict[int, str | None] = {}
            while True:
                output = await stream.get()
                for seq in output.outputs:
                    outputs[seq.index] = seq.finish_reason
                if output.finished:
                    break
            assert outputs == {0: "length", 1: "length"}
            assert engine2.stats.aborted_by_reason == {}
        finally:
            await engine2.shutdown()
        assert_pool_free(engine)
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------- streams


async def test_keep_alive_comments_while_a_stream_waits_in_the_queue(serve):
    engine = await build_engine(step_delay=0.02, max_num_seqs=1)
    server = await serve(engine, ServerConfig(sse_keep_alive_interval=0.05))
    async with aiohttp.ClientSession() as session:
        long = {"prompt": [5], "max_tokens": 25, **LONG}
        blocker = asyncio.create_task(post(session, f"{server.url}/v1/completions", long))
        await wait_until(lambda: engine.scheduler.num_running == 1)
        body = {"prompt": [7, 8], "max_tokens": 3, "stream": True}
        status, headers, raw = await post(session, f"{server.url}/v1/completions", body)
        assert (await blocker)[0] == 200
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    head = raw[: raw.index(b"data: ")]
    assert head.count(KEEP_ALIVE) >= 3 and head == KEEP_ALIVE * head.count(KEEP_ALIVE)
    assert stream_choices(raw) == {0: (expected_output([7, 8], 3)[1], "length")}


async def _small_send_buffer(request: web.Request, response: web.StreamResponse) -> None:
    """Shrink the server side of the socket so that a client that stops reading blocks the
    writer after tens of kilobytes, not megabytes."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


async def _stalled_stream(server: LiveServer) -> socket.socket:
    """A client with a small receive buffer that asks for a big stream and never reads it."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    host, port = server.url.removeprefix("http://").split(":")
    await loop.sock_connect(sock, (host, int(port)))
    # About 1.5 MB of events (16 choices x 120 tokens x 20 logprobs) over 1.2 s of steps.
    body = orjson.dumps({"prompt": [5], "max_tokens": 120, "n": 16, "logprobs": 20,
                         "stream": True, **LONG})  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    await loop.sock_sendall(sock, head.encode() + body)
    return sock


async def test_a_client_that_stops_reading_is_aborted_after_the_write_timeout(caplog):
    engine = await build_engine(step_delay=0.01)
    app = create_app(engine, ServerConfig(stream_write_timeout=0.3))
    app.on_response_prepare.append(_small_send_buffer)
    server = await LiveServer(app).start()
    loop = asyncio.get_running_loop()
    sock = None
    try:
        sock = await _stalled_stream(server)
        start = time.monotonic()
        async with aiohttp.ClientSession() as session:
            while engine.num_unfinished or not engine.stats.aborted:
                assert time.monotonic() - start < 5, "the stalled request was never aborted"
                t0 = time.monotonic()
                async with session.get(f"{server.url}/health") as response:
                    assert response.status == 200
                assert time.monotonic() - t0 < 0.5  # the loop is not blocked meanwhile
                await asyncio.sleep(0.05)
        assert time.monotonic() - start < 1.2  # before the request could have finished
        assert engine.stats.aborted_by_reason == {"write_timeout": 1}
        assert_pool_free(engine)
        received = 0  # the server closed the connection: what was buffered, then the end
        while True:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += len(chunk)
        assert received < 1 << 20
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        if sock is not None:
            sock.close()
        await server.stop()
        await engine.shutdown()


async def test_a_stalled_client_that_resets_is_a_disconnect_not_an_error(caplog):
    engine = await build_engine(step_delay=0.01)
    app = create_app(engine, ServerConfig(stream_write_timeout=30))
    app.on_response_prepare.append(_small_send_buffer)
    server = await LiveServer(app).start()
    try:
        sock = await _stalled_stream(server)
        await asyncio.sleep(0.4)  # the writer waits for the socket to drain by now
        assert engine.num_unfinished == 1
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, while the server waits to write
        await wait_until(lambda: engine.num_unfinished == 0, 1.0)
        assert engine.stats.aborted_by_reason == {"client_disconnect": 1}
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert_pool_free(engine)
    finally:
        await server.stop()
        await engine.shutdown()


# --------------------------------------------------------------------------- shutdown


async def test_drain_lets_requests_finish_then_aborts_the_rest(serve):
    engine = await build_engine(step_delay=0.02)
    server = await serve(engine)
    url = f"{server.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        short = asyncio.create_task(
            post(session, url, {"prompt": [6], "max_tokens": 8, "stream": True})
        )
        long_stream = asyncio.create_task(
            post(session, url, {"prompt": [7], "max_tokens": 100, "stream": True, **LONG})
        )
        long_json = asyncio.create_task(post(session, url, {"prompt": [8], "max_tokens": 100}))
        await wait_until(lambda: engine.scheduler.num_running == 3)
        start = time.monotonic()
        draining = asyncio.create_task(drain(server.app, timeout=0.5))
        await asyncio.sleep(0.05)
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 503
        status, _, raw = await post(session, url, {"prompt": [9], "max_tokens": 2})
        assert status == 503 and "shutting down" in error_of(raw, 503)["message"]
        assert await draining == 2
        assert 0.5 <= time.monotonic() - start < 1.5
        status, _, raw = await short
        assert stream_choices(raw) == {0: (expected_output([6], 8)[1], "length")}
        status, _, raw = await long_stream
        [(text, reason)] = stream_choices(raw).values()
        assert status == 200 and reason == "abort"
        assert expected_output([7], 100)[1].startswith(text)
        status, _, raw = await long_json
        assert status == 200 and orjson.loads(raw)["choices"][0]["finish_reason"] == "abort"
    assert engine.stats.aborted_by_reason == {"shutdown": 2}
    assert_pool_free(engine)


# --------------------------------------------------------------------------- engine faults


async def test_engine_death_before_the_first_token_is_a_plain_500(serve):
    engine = await build_engine(fail_at_step=0)
    fatal: list[BaseException] = []
    server = await serve(engine, on_fatal=fatal.append)
    body = {"prompt": [5], "max_tokens": 5, "stream": True}
    async with aiohttp.ClientSession() as session:
        status, headers, raw = await post(session, f"{server.url}/v1/completions", body)
        assert status == 500 and headers["Content-Type"].startswith("application/json")
        assert "device lost" in error_of(raw, 500)["message"]
        await wait_until(lambda: bool(fatal), 1.0)  # the process is told at once
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 503
    assert [str(e) for e in fatal] == ["device lost"]


async def test_engine_death_mid_stream_is_an_error_event_then_done(serve):
    engine = await build_engine(step_delay=0.02, fail_at_step=4)
    server = await serve(engine)
    body = {"prompt": [5], "max_tokens": 20, "stream": True, "n": 2}
    async with aiohttp.ClientSession() as session:
        status, _, raw = await post(session, f"{server.url}/v1/completions", body)
    events = data_events(raw)
    assert status == 200 and orjson.loads(events[0])["choices"]
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == 500 and "device lost" in error["message"]


async def test_a_stuck_step_kills_the_engine_after_the_watchdog_timeout(serve):
    """A step that never returns (a hung kernel or device): past the watchdog's limit the
    stream gets an error event and [DONE], /health turns 503 and the process is told, while
    steps just under the limit go on as usual."""
    release = threading.Event()
    engine = await build_engine(step_delay=0.2, hang_at_step=12, release=release, step_timeout=0.6)
    fatal: list[BaseException] = []
    server = await serve(engine, on_fatal=fatal.append)
    try:
        body = {"prompt": [5], "max_tokens": 50, "stream": True}
        async with aiohttp.ClientSession() as session:
            url = f"{server.url}/v1/completions"
            status, _, raw = await asyncio.wait_for(post(session, url, body), 10)
            async with session.get(f"{server.url}/health") as response:
                assert response.status == 503
    finally:
        release.set()
    events = data_events(raw)
    assert status == 200 and len(events) == 12 + 2  # 12 tokens, the error, [DONE]
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == 500 and "watchdog timeout" in error["message"]
    assert [type(e).__name__ for e in fatal] == ["StepTimeoutError"]


async def test_the_watchdog_times_each_piece_of_gpu_work_from_its_start(serve):
    """Work queued on the GPU thread ahead of a step (a LoRA adapter loading, say) does not
    count against the step: a 0.8 s load, then a 0.4 s step, under a 1 s watchdog (margins of
    0.2 s and more, so that a loaded machine's scheduling does not trip it)."""
    engine = await build_engine(step_delay=0.4, step_timeout=1.0)
    fatal: list[BaseException] = []
    server = await serve(engine, on_fatal=fatal.append)
    body = {"prompt": [5], "max_tokens": 6}
    async with aiohttp.ClientSession() as session:
        url = f"{server.url}/v1/completions"
        answer = asyncio.create_task(post(session, url, body))
        await asyncio.sleep(0.1)
        await asyncio.wrap_future(engine.gpu.call(lambda: time.sleep(0.8)))
        status, _, raw = await asyncio.wait_for(answer, 10)
    assert status == 200 and orjson.loads(raw)["choices"][0]["finish_reason"] == "length"
    assert fatal == [] and engine.dead_error is None


# --------------------------------------------------------------------------- security


SECRET_PROMPT = "my-private-prompt-text-8142"
KEY = "sk-secret-key-5531"
WRONG_KEY = "sk-wrong-key-9975"


async def _exercise(url: str) -> None:
    """Successful, streamed, refused and abandoned requests carrying the secrets."""
    good = {"Authorization": f"Bearer {KEY}"}
    chat = {"messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        for headers in (good, {"Authorization": f"Bearer {WRONG_KEY}"}):
            await post(session, f"{url}/v1/completions", {"prompt": SECRET_PROMPT}, headers=headers)
        await post(session, f"{url}/v1/chat/completions", {**chat, "stream": True}, headers=good)
        await post(session, f"{url}/v1/chat/completions", chat, headers=good)
        bad = {"prompt": SECRET_PROMPT, "max_tokens": "x"}
        status, _, _ = await post(session, f"{url}/v1/completions", bad, headers=good)
        assert status == 400
        await post(session, f"{url}/tokenize", {"prompt": SECRET_PROMPT}, headers=good)


async def test_logs_hold_no_keys_and_no_prompt_text_unless_asked(serve, caplog):
    caplog.set_level(logging.DEBUG)
    engine = await build_engine()
    config = ServerConfig(api_key=(KEY,), log_requests=True)
    server = await serve(engine, config)
    await _exercise(server.url)
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records)
    assert "/v1/chat/completions: status 200" in logged  # the request log is on
    for secret in (KEY, WRONG_KEY, SECRET_PROMPT):
        assert secret not in logged, secret
    caplog.clear()
    verbose = await serve(engine, ServerConfig(api_key=(KEY,), log_requests=True,
                                               log_prompts=True))  # fmt: skip
    await _exercise(verbose.url)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET_PROMPT in logged  # asked for: the prompt text is there
    assert KEY not in logged and WRONG_KEY not in logged


async def test_model_names_are_never_opened_as_paths(serve, tmp_path: Path):
    model_dir = tmp_path / "a-model-folder"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    touched: list[str] = []
    watching = [True]

    def audit(event: str, args: tuple[Any, ...]) -> None:
        watched = event in ("open", "os.listdir", "os.scandir", "os.stat")
        if watching[0] and watched and args and str(model_dir) in str(args[0]):
            touched.append(f"{event} {args[0]}")

    sys.addaudithook(audit)  # hooks cannot be removed: this one is switched off below
    try:
        (model_dir / "config.json").read_text()
        assert touched, "the audit hook sees file opens"
        touched.clear()
        engine = await build_engine()
        server = await serve(engine)
        names = (str(model_dir), str(model_dir / "config.json"), "../" * 8 + "etc/passwd")
        async with aiohttp.ClientSession() as session:
            for name in names:
                for path, body in (
                    ("/v1/completions", {"prompt": "a", "model": name}),
                    ("/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "a"}], "model": name}),
                    ("/tokenize", {"prompt": "a", "model": name}),
                ):  # fmt: skip
                    status, _, raw = await post(session, server.url + path, body)
                    assert status == 404 and error_of(raw, 404)["param"] == "model"
                quoted = urllib.parse.quote(name, safe="")
                async with session.get(f"{server.url}/v1/models/{quoted}") as response:
                    assert response.status == 404
        assert touched == []
    finally:
        watching[0] = False
