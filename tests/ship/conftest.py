"""A live `aioinfer serve` subprocess on a tiny random model, shared by the tests of this folder.

It serves over TCP on a free port with an API key, and keeps the lines of its startup log so that
tests can compare them with what `aioinfer plan` predicts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.model.tiny_models import make_variant
from tests.tokenizer_fixtures import make_tokenizer

READY_TIMEOUT = 120
API_KEY = "ship-test-key"
# The flags of the shared server; tests/ship/test_plan.py plans with the same ones.
SERVE_FLAGS = {
    "device": "cpu",
    "kv_cache_memory": 0.01,
    "max_model_len": 200,
    "served_model_name": "tiny",
}


@dataclass
class LiveServer:
    url: str
    model_dir: Path
    log: list[str]
    flags: dict[str, object]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_flags(flags: dict[str, object]) -> list[str]:
    out: list[str] = []
    for name, value in flags.items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


def start_server(
    args: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `python -m aioinfer serve ARGS`; return once its log says it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioinfer", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    lines: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if "Ready in" in line:
            return proc, lines
    proc.kill()
    raise AssertionError("server did not become ready:\n" + "\n".join(lines))


def stop_server(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-ship")
    make_variant("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    port = free_port()
    args = [str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port)]
    proc, lines = start_server([*args, *cli_flags(SERVE_FLAGS)], env={"AIOINFER_API_KEY": API_KEY})
    # Drain the log in the background so that the server never blocks on a full pipe.
    assert proc.stdout is not None
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield LiveServer(f"http://127.0.0.1:{port}", tiny_model_dir, lines, dict(SERVE_FLAGS))
    assert stop_server(proc) == 0
