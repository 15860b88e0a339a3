"""What `aioinfer serve` warns about at start: a server every route of which is open to the
network, runtime LoRA loading without a root for its paths, and a waiting queue without a
bound."""

from __future__ import annotations

import logging

import pytest

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from aioinfer.engine.event_loop import EVENT_LOOP_ENV
from aioinfer.server.launch import is_loopback, warn_if_exposed, warn_if_unbounded
from aioinfer.server.openai.lora import RUNTIME_LORA_ENV, VLLM_RUNTIME_LORA_ENV


@pytest.fixture(autouse=True)
def _no_runtime_lora(monkeypatch):
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    monkeypatch.delenv(VLLM_RUNTIME_LORA_ENV, raising=False)


def warnings_of(caplog, config: ServerConfig) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aioinfer"):
        warn_if_exposed(config)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org", ""])
def test_a_server_open_to_the_network_without_a_key_is_a_warning(caplog, host):
    [line] = warnings_of(caplog, ServerConfig(host=host))
    assert "without an API key" in line and "--api-key" in line
    assert warnings_of(caplog, ServerConfig(host=host, api_key=("k",))) == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_or_a_unix_socket_without_a_key_is_no_warning(caplog, host):
    assert is_loopback(host)
    assert warnings_of(caplog, ServerConfig(host=host)) == []
    assert warnings_of(caplog, ServerConfig(uds="/tmp/aioinfer.sock")) == []


def test_runtime_lora_loading_without_a_root_is_a_warning(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv(VLLM_RUNTIME_LORA_ENV, "true")
    [line] = warnings_of(caplog, ServerConfig(host="127.0.0.1"))
    assert "--lora-root" in line
    assert warnings_of(caplog, ServerConfig(host="127.0.0.1", lora_root=str(tmp_path))) == []
    missing = str(tmp_path / "missing")
    [line] = warnings_of(caplog, ServerConfig(host="127.0.0.1", lora_root=missing))
    assert "is not a folder" in line


def test_a_waiting_queue_without_a_bound_is_a_warning(caplog):
    def warnings(config: SchedulerConfig) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="aioinfer"):
            warn_if_unbounded(config)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    [line] = warnings(SchedulerConfig())
    assert "--max-queued-requests" in line and "--max-queued-tokens" in line
    assert warnings(SchedulerConfig(max_queued_requests=64)) == []
    assert warnings(SchedulerConfig(max_queued_tokens=1 << 20)) == []


def test_serve_refuses_an_unknown_loop_in_one_line_before_it_starts(capsys, monkeypatch):
    from aioinfer.server import launch

    async def serve(*args):
        raise AssertionError("the server starts")

    monkeypatch.setattr(launch, "_serve", serve)
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    configs = ModelConfig(), CacheConfig(), SchedulerConfig(), ServerConfig()
    assert launch.run_server(*configs) == 2
    err = capsys.readouterr().err
    assert err == f"Error: {EVENT_LOOP_ENV} must be auto, asyncio or uvloop, got 'trio'\n"
