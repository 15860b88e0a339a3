"""`aioinfer chat`, `aioinfer complete` and `aioinfer plan` as commands, in subprocesses. Each
test skips while its command is not registered in aioinfer/cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aioinfer.cli.client import API_KEY_ENV
from aioinfer.cli.main import app
from aioinfer.cli.plan import build_plan_configs, make_plan
from tests.ship.conftest import API_KEY, LiveServer, cli_flags
from tests.ship.test_client import FIRST, MAX_TOKENS, reference_chat, reference_completion
from tests.support.serve_process import free_port


def command(name: str) -> pytest.MarkDecorator:
    names = {c.name for c in app.registered_commands}
    return pytest.mark.skipif(name not in names, reason=f"`aioinfer {name}` is not in cli.py yet")


def aioinfer(*args: str, stdin: str | None = None, key: str | None = API_KEY):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if key is not None:
        env[API_KEY_ENV] = key
    return subprocess.run(
        [sys.executable, "-m", "aioinfer", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@command("plan")
def test_plan_command_prints_what_make_plan_computes(live_server: LiveServer):
    result = aioinfer("plan", str(live_server.model_dir), "--json", *cli_flags(live_server.flags))
    assert result.returncode == 0, result.stderr
    flags = {"model": str(live_server.model_dir), **live_server.flags}
    assert json.loads(result.stdout) == json.loads(
        json.dumps(make_plan(*build_plan_configs(flags)).to_dict())
    )


@command("plan")
def test_plan_command_exit_codes(live_server: LiveServer):
    folder = str(live_server.model_dir)
    # vLLM's spelling of the length is taken, as by serve (it was "not a valid integer").
    refused = aioinfer(
        "plan", folder, "--device", "cpu", "--kv-cache-memory", "0.00002", "--max-model-len", "0.2k"
    )
    assert refused.returncode == 1 and "serve would not start" in refused.stdout
    bad = aioinfer("plan", folder, "--dtype", "float64")
    assert bad.returncode == 2 and "dtype must be one of" in bad.stderr


@command("complete")
def test_complete_command(live_server: LiveServer):
    args = ["--url", live_server.url, "--max-tokens", "5", "--temperature", "0"]
    result = aioinfer("complete", "Hello", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == reference_completion(live_server, "Hello", 5).rstrip("\n")
    piped = aioinfer("complete", "-", *args, stdin="Hello")
    assert piped.stdout == result.stdout
    refused = aioinfer("complete", "Hello", *args, "--api-key", "wrong")
    assert refused.returncode == 1 and "401" in refused.stderr


@command("chat")
def test_chat_command_with_piped_input(live_server: LiveServer):
    args = ["--url", live_server.url, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    result = aioinfer("chat", *args, "--system", "Be brief.", stdin=f"{FIRST}\n/exit\n")
    assert result.returncode == 0, result.stderr
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": FIRST},
    ]
    assert result.stdout == reference_chat(live_server, messages) + "\n"


@pytest.mark.parametrize("name", ["chat", "complete"])
def test_commands_without_a_server_exit_1(name):
    if name not in {c.name for c in app.registered_commands}:
        pytest.skip(f"`aioinfer {name}` is not in cli.py yet")
    args = ["complete", "x"] if name == "complete" else ["chat"]
    result = aioinfer(*args, "--url", f"http://127.0.0.1:{free_port()}", key=None)
    assert result.returncode == 1
    assert result.stderr.startswith("Error: No aioinfer server answers at")
