"""Clients that leave early abort their requests, and every KV block returns to the pool.

The live server runs with aiohttp's default settings (handlers are not cancelled on
disconnect), so the app must notice by itself; the test client's server does cancel handlers,
which is the other path. Requests are made slow (20 ms per step) so that they are still running
when the client leaves; each would take seconds to finish on its own.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from aioinfer.server.app import create_app
from tests.server.conftest import LiveServer, assert_pool_free, build_engine

LONG = {"max_tokens": 100, "ignore_eos": True}
ABORT_DEADLINE = 1.0  # seconds; finishing on their own would take about 2 s


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def raw_request(server: LiveServer, path: str, body: dict):
    """A hand-written HTTP/1.1 request on a socket that the test can simply close."""
    host, port = server.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    return reader, writer


async def assert_aborted_quickly(engine, num_aborted_before: int, count: int = 1) -> None:
    start = time.monotonic()
    await wait_until(lambda: engine.num_unfinished == 0)
    assert time.monotonic() - start < ABORT_DEADLINE
    assert engine.stats.aborted == num_aborted_before + count
    await asyncio.sleep(0)  # the blocks are free before the next step
    assert_pool_free(engine)


async def check_a_leaving_client_frees_its_blocks(
    live_factory, path: str, body: dict, first_event: bytes | None
) -> None:
    """A client sends `body` to `path` and leaves: once `first_event` came (streamed), or
    while its request runs (not streamed). Its request is aborted and its blocks freed."""
    engine = await build_engine(step_delay=0.02)
    try:
        server = await live_factory(engine)
        reader, writer = await raw_request(server, path, body)
        if first_event is not None:
            await reader.readuntil(first_event)
        else:
            await wait_until(lambda: engine.scheduler.num_running == 1)
        writer.close()
        await assert_aborted_quickly(engine, 0)
    finally:
        await engine.shutdown()


async def test_streaming_clients_that_leave_abort(live_factory):
    engine = await build_engine(step_delay=0.02)
    try:
        server = await live_factory(engine)
        body = {"prompt": [5, 6, 7], "stream": True, "n": 2, **LONG}
        readers = [await raw_request(server, "/v1/completions", body) for _ in range(3)]
        for reader, _ in readers:
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            await reader.readuntil(b"data: ")  # a token has been streamed
        assert engine.num_unfinished == 3
        for _, writer in readers:
            writer.close()
        await assert_aborted_quickly(engine, 0, count=3)
    finally:
        await engine.shutdown()


async def test_non_streaming_client_that_leaves_aborts(live_factory):
    engine = await build_engine(step_delay=0.02)
    try:
        server = await live_factory(engine)
        body = {"messages": [{"role": "user", "content": "hi"}], **LONG}
        _, writer = await raw_request(server, "/v1/chat/completions", body)
        await wait_until(lambda: engine.scheduler.num_running == 1)
        writer.close()
        await assert_aborted_quickly(engine, 0)
    finally:
        await engine.shutdown()


async def test_waiting_request_of_a_client_that_leaves_is_aborted(live_factory):
    engine = await build_engine(step_delay=0.02, max_num_seqs=1)
    try:
        server = await live_factory(engine)
        body = {"prompt": [5, 6], "max_tokens": 30, "ignore_eos": True}
        first = await raw_request(server, "/v1/completions", body)
        await wait_until(lambda: engine.scheduler.num_running == 1)
        _, writer = await raw_request(server, "/v1/completions", {**body, "stream": True})
        await wait_until(lambda: engine.scheduler.num_waiting == 1)
        writer.close()  # it never ran: no token was ever written to it
        await wait_until(lambda: engine.scheduler.num_waiting == 0, ABORT_DEADLINE)
        assert engine.stats.aborted == 1
        head = await first[0].readuntil(b"\r\n\r\n")  # the other one is unaffected
        assert head.startswith(b"HTTP/1.1 200")
        first[1].close()
        await wait_until(lambda: engine.num_unfinished == 0)
        assert_pool_free(engine)
    finally:
        await engine.shutdown()


async def test_disconnect_with_handler_cancellation(aiohttp_client):
    engine = await build_engine(step_delay=0.02)
    try:
        client = await aiohttp_client(create_app(engine))
        body = {"prompt": [9, 9], "stream": True, **LONG}
        response = await client.post("/v1/completions", json=body)
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
        response.close()
        await assert_aborted_quickly(engine, 0)
        task = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": False}))
        await wait_until(lambda: engine.scheduler.num_running == 1)
        task.cancel()
        await assert_aborted_quickly(engine, 1)
    finally:
        await engine.shutdown()


async def test_server_keeps_serving_after_disconnects(live_factory):
    engine = await build_engine(step_delay=0.002)
    try:
        server = await live_factory(engine)
        body = {"prompt": [5, 6, 7], "stream": True, **LONG}
        for _ in range(5):
            reader, writer = await raw_request(server, "/v1/completions", body)
            await reader.readuntil(b"data: ")
            writer.close()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{server.url}/v1/completions", json={"prompt": [5], "max_tokens": 3}
            ) as response,
        ):
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] == 3
        await wait_until(lambda: engine.num_unfinished == 0)
        assert_pool_free(engine)
        assert engine.stats.aborted == 5
    finally:
        await engine.shutdown()


async def test_a_client_that_leaves_while_its_prompt_is_tokenized_is_let_go(
    live_factory, monkeypatch
):
    """Off-loop work runs under the disconnect watcher too: the handler stops waiting for a
    long prompt's tokenization once its client is gone, and no engine request follows."""
    import threading

    from aioinfer.server.http.state import STATE
    from aioinfer.server.openai import completions

    started, gate = threading.Event(), threading.Event()
    encode = completions.encode_prompts

    def held(tokenizer, prompt, *args):
        started.set()
        gate.wait(10)
        return encode(tokenizer, "hi", *args)  # a prompt that fits the test model

    monkeypatch.setattr(completions, "encode_prompts", held)
    engine = await build_engine()
    try:
        server = await live_factory(engine)
        state = server.app[STATE]
        body = {"prompt": "word " * 5000, "max_tokens": 1}  # tokenized off the loop
        _, writer = await raw_request(server, "/v1/completions", body)
        await wait_until(started.is_set)
        writer.close()
        await wait_until(lambda: state.in_flight == 0, ABORT_DEADLINE)  # the gate still shut
        gate.set()
        await asyncio.sleep(0.2)
        assert engine.num_unfinished == 0 and engine.stats.aborted == 0
        assert_pool_free(engine)
    finally:
        gate.set()
        await engine.shutdown()


async def test_off_loop_preparation_is_bounded_and_let_go_when_clients_leave(
    live_factory, monkeypatch
):
    """Long prompts are tokenized (and large bodies validated, large chats rendered) on
    threads of their own with a bounded queue: they waited on the loop's default executor,
    whose queue has no bound, so a client could queue minutes of work ahead of everyone's
    large requests. Past the bound a fast 503 with Retry-After, small requests still served
    on the loop; work whose client left while it waited is dropped, never run."""
    import threading

    from aioinfer.server.http.work_queue import OFF_LOOP
    from aioinfer.server.openai import completions

    monkeypatch.setattr(OFF_LOOP, "max_waiting", 2)
    gate = threading.Event()
    tokenized: list[str] = []
    encode = completions.encode_prompts

    def held(tokenizer, prompt, *args):
        if len(prompt) < 100:  # tokenized on the loop
            return encode(tokenizer, prompt, *args)
        tokenized.append(prompt.split(" ", 1)[0])
        gate.wait(30)
        return encode(tokenizer, "hi", *args)  # a prompt that fits the test model

    monkeypatch.setattr(completions, "encode_prompts", held)
    engine = await build_engine()

    def body(name: str, words: int = 5000) -> dict:
        return {"prompt": f"{name} " + "word " * words, "max_tokens": 1}  # off the loop

    try:
        server = await live_factory(engine)
        threads = OFF_LOOP.threads
        running = [
            await raw_request(server, "/v1/completions", body(f"r{i}")) for i in range(threads)
        ]
        await wait_until(lambda: len(tokenized) == threads)
        waiting = [await raw_request(server, "/v1/completions", body(f"w{i}")) for i in range(2)]
        await wait_until(lambda: OFF_LOOP.in_flight == threads + 2)
        async with aiohttp.ClientSession() as session:
            # a long prompt, and a body large enough to be validated off the loop
            for refused in (body("x"), body("y", words=14_000)):
                start = time.monotonic()
                async with session.post(f"{server.url}/v1/completions", json=refused) as response:
                    error = orjson.loads(await response.read())["error"]
                    assert response.status == 503 and response.headers["Retry-After"] == "1"
                assert "large requests to validate, render or tokenize" in error["message"]
                assert time.monotonic() - start < 1.0
            small = {"prompt": "hi", "max_tokens": 1}
            async with session.post(f"{server.url}/v1/completions", json=small) as response:
                assert response.status == 200
        for _, writer in waiting:
            writer.close()
        await wait_until(lambda: OFF_LOOP.in_flight == threads, timeout=ABORT_DEADLINE)
        gate.set()
        for reader, writer in running:
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n"), 30)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200"), answer
        assert sorted(tokenized) == sorted(f"r{i}" for i in range(threads))  # none waited in vain
        await wait_until(lambda: OFF_LOOP.in_flight == 0 and engine.num_unfinished == 0)
        assert_pool_free(engine)
    finally:
        gate.set()
        await engine.shutdown()
