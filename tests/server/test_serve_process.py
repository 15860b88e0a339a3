"""`aioinfer serve` as a real subprocess: the startup log and the socket, TCP and Unix."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from pathlib import Path

import aiohttp
import pytest

from tests.support.serve_process import ServeProcess, free_port, make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-serve"))


def start_server(args: list[str]) -> tuple[ServeProcess, list[str]]:
    """`aioinfer serve ARGS`, once its log says it is ready, and the log lines so far."""
    proc = ServeProcess(args)
    proc.wait_ready()
    return proc, list(proc.lines)


def stop_server(proc: ServeProcess) -> int:
    return proc.stop()


def grab(lines: list[str], pattern: str) -> re.Match[str]:
    for line in lines:
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matches {pattern!r}:\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def tcp_server(tiny_model_dir):
    # Port 0: the system picks a free one, and the log names it.
    proc, lines = start_server(
        [str(tiny_model_dir), "--host", "127.0.0.1", "--port", "0",
         "--kv-cache-memory", "0.01", "--max-model-len", "200", "--block-size", "16",
         "--served-model-name", "tiny"]
    )  # fmt: skip
    port = int(grab(lines, r"Listening on http://127\.0\.0\.1:(\d+);").group(1))
    assert port != 0
    yield port, lines
    assert stop_server(proc) == 0


def test_tcp_startup_log_numbers_agree(tcp_server):
    port, lines = tcp_server
    order = [
        "non-default args: {",
        "Initializing engine with config: ",
        "Chunked prefill is enabled with max_num_batched_tokens=",
        "Using max model len 200",
        "Loading weights took",
        "Model loading took",
        "Available KV cache memory:",
        "KV cache size:",
        "CUDA graphs are off",
        "init engine (profile, create kv cache, warmup model) took",
        f"Starting aioinfer server on http://127.0.0.1:{port}",
        "Ready in",
    ]
    positions = [next(i for i, line in enumerate(lines) if text in line) for text in order]
    assert positions == sorted(positions)
    usable = int(grab(lines, r"KV cache blocks: (\d+) usable").group(1))
    size = grab(lines, r"KV cache size: (\d+) tokens, Maximum concurrency for (\d+) tokens "
                       r"per request: ([\d.]+)x")  # fmt: skip
    tokens, max_len, concurrency = int(size[1]), int(size[2]), float(size[3])
    assert tokens == usable * 16
    assert max_len == 200
    assert concurrency == pytest.approx(tokens / max_len, abs=0.005)


async def test_openai_client_against_the_real_engine(tcp_server):
    import openai

    port, _ = tcp_server
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    try:
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        messages = [{"role": "user", "content": "Hello, world!"}]
        whole = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=5
        )
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=5,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(pieces) == whole.choices[0].message.content
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model="tiny", prompt="x", max_tokens=500)
        assert "200" in str(err.value)
    finally:
        await client.close()
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        text = await resp.text()
    assert "aioinfer:" in text and "generation_tokens" in text


async def test_unix_socket(tiny_model_dir, tmp_path):
    sock = str(tmp_path / "aioinfer.sock")
    proc, lines = start_server(
        [str(tiny_model_dir), "--uds", sock, "--kv-cache-memory", "0.01", "--max-model-len", "128"]
    )
    try:
        assert any(f"Starting aioinfer server on unix:{sock}" in line for line in lines)
        connector = aiohttp.UnixConnector(path=sock)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get("http://localhost/health") as resp:
                assert resp.status == 200
            async with session.get("http://localhost/v1/models") as resp:
                assert (await resp.json())["data"][0]["max_model_len"] == 128
        # A second server on the same path is refused instead of taking the socket over.
        second = ServeProcess([str(tiny_model_dir), "--uds", sock])
        code, _ = await asyncio.to_thread(second.wait_exit, 120)
        assert code != 0 and "Another server listens on" in second.output
    finally:
        assert stop_server(proc) == 0
    assert not os.path.exists(sock)  # removed on exit


def test_a_port_in_use_is_refused_in_one_line(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = ServeProcess([str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port)])
        code, _ = proc.wait_exit(120)
    assert code == 1, proc.output
    assert f"Cannot listen on http://127.0.0.1:{port}: " in proc.output
    assert "address already in use" in proc.output
    assert "Traceback" not in proc.output


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("missing", (), "does not exist"),
        ("tiny", ("--max-model-len", "100000"), r"max_model_len \(100000\) is larger than"),
    ],
)
def test_a_configuration_error_exits_with_one_line(tiny_model_dir, tmp_path, model, flags, message):
    path = tiny_model_dir if model == "tiny" else tmp_path / "missing"
    proc = ServeProcess([str(path), "--host", "127.0.0.1", "--port", str(free_port()), *flags])
    code, _ = proc.wait_exit(120)
    assert code == 1, proc.output
    errors = [line for line in proc.lines if "ERROR" in line]
    assert len(errors) == 1 and re.search(f"the engine failed to start: .*{message}", errors[0])
    assert "Traceback" not in proc.output
