"""The command line: generated flags, grouped help, version, config errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aioinfer import __version__
from aioinfer.cli.main import build_configs, serve_help


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioinfer", *args], capture_output=True, text=True, timeout=60
    )


def test_plain_help_lists_the_groups():
    text = serve_help(None)
    for group in ("ModelConfig", "CacheConfig", "SchedulerConfig", "ServerConfig"):
        assert group in text
    assert "--max-num-seqs" in text and "--enable-prefix-caching" in text


def test_help_topics():
    assert "--gpu-memory-utilization  [default: 0.92]" in serve_help("all")
    one = serve_help("max-num-seqs")
    assert one.strip().startswith("--max-num-seqs") and "else 256, as vLLM" in one
    group = serve_help("SchedulerConfig")
    assert "--max-num-batched-tokens" in group and "--host" not in group
    with pytest.raises(KeyError):
        serve_help("no-such-flag")
    # vLLM's flags that are dropped or read under another name say so.
    assert "dropped with a note: routes are served at /" in serve_help("root-path")
    renamed = serve_help("--max-num-queued-reqs")
    assert "read as --max-queued-requests: it bounds" in renamed and "[default: None]" in renamed
    assert "read as --log-requests\n  --log-requests" in serve_help("enable-log-requests")


def test_subprocess_help_version_and_errors():
    result = run_cli("serve", "--help=max-num-seqs")
    assert result.returncode == 0 and "Most requests in one step" in result.stdout
    assert run_cli("--version").stdout.strip() == f"aioinfer {__version__}"
    bad = run_cli("serve", "--gpu-memory-utilization", "1.5")
    assert bad.returncode == 2 and "gpu_memory_utilization must be in (0, 1]" in bad.stderr
    unknown = run_cli("serve", "--help=bogus")
    assert unknown.returncode == 2


def test_api_keys_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("AIOINFER_API_KEY", "k2, k3")
    _, _, _, server = build_configs({"port": 9000})
    assert server.api_key == ("k2", "k3") and server.port == 9000
    # The flag wins over the variable, as vLLM's does.
    assert build_configs({"api_key": ["k1"]})[3].api_key == ("k1",)


def test_repeated_flags_become_tuples():
    _, _, _, server = build_configs({"allowed_origins": ["https://a.example", "https://b.example"]})
    assert server.allowed_origins == ("https://a.example", "https://b.example")
