"""A live `aioinfer serve` subprocess on a tiny random model, shared by the tests of this folder.

It serves over TCP on a free port with an API key, and keeps the lines of its startup log so that
tests can compare them with what `aioinfer plan` predicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.serve_process import ServeProcess, free_port, make_tiny_model_dir

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


def cli_flags(flags: dict[str, object]) -> list[str]:
    out: list[str] = []
    for name, value in flags.items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-ship"))


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    port = free_port()
    args = [str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port)]
    proc = ServeProcess([*args, *cli_flags(SERVE_FLAGS)], env={"AIOINFER_API_KEY": API_KEY})
    proc.wait_ready()
    yield LiveServer(
        f"http://127.0.0.1:{port}", tiny_model_dir, list(proc.lines), dict(SERVE_FLAGS)
    )
    assert proc.stop() == 0
