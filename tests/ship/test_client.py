"""`aioinfer chat` and `aioinfer complete` against a live server: streaming, history, errors.

The chat runs in a pseudo-terminal, as a user would run it. Replies are checked against the
official `openai` client's non-streamed answers from the same server (greedy, so the two agree).
"""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import openai
import pytest

from aioinfer.cli.client import (
    API_KEY_ENV,
    THINKING,
    ChatPiece,
    ChatSession,
    Client,
    ClientError,
    chat_main,
    complete_main,
    iter_sse_events,
    normalize_url,
)
from tests.ship.conftest import API_KEY, LiveServer
from tests.support.serve_process import free_port

MAX_TOKENS = 8
FIRST = "Hello, world!"
SECOND = "How are you today?"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\x1b[=>]")


def reference_chat(server: LiveServer, messages: list[dict[str, str]]) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    return reply.choices[0].message.content or ""


def reference_completion(server: LiveServer, prompt: str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].text


def python_entry(call: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        f"import sys; from aioinfer.cli.client import *; sys.exit({call})",
    ]


# ----------------------------------------------------------------------------- chat in a pty


class Terminal:
    """A child process on a pseudo-terminal: type lines, read what the screen shows."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self.screen = ""

    def read_until(self, marker: str, start: int, timeout: float = 60.0) -> int:
        """Read until `marker` shows after offset `start`; return the offset just past it."""
        deadline = time.monotonic() + timeout
        while (found := self.screen.find(marker, start)) < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{marker!r} never showed; the screen:\n{self.screen}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"the terminal closed; the screen:\n{self.screen}")
                self.screen += ANSI.sub("", chunk.decode("utf-8", "replace")).replace("\r", "")
        return found + len(marker)

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)


def test_chat_in_a_terminal_streams_and_keeps_the_history(live_server):
    env = {**os.environ, "TERM": "dumb", API_KEY_ENV: API_KEY, "PYTHONUNBUFFERED": "1"}
    call = f"chat_main(url={live_server.url!r}, max_tokens={MAX_TOKENS}, temperature=0)"
    term = Terminal(python_entry(call), env)
    try:
        pos = term.read_until(">>> ", 0)
        assert "Chatting with tiny at" in term.screen[:pos]
        term.type(FIRST + "\n")
        start = term.read_until(FIRST + "\n", pos)
        end = term.read_until("\n>>> ", start)
        first_reply = term.screen[start : end - len("\n>>> ")]
        term.type(SECOND + "\n")
        start = term.read_until(SECOND + "\n", end)
        end = term.read_until("\n>>> ", start)
        second_reply = term.screen[start : end - len("\n>>> ")]
        term.type("\x04")  # Ctrl-D on an empty line: end of input
    finally:
        code = term.close()
    assert code == 0

    history = [{"role": "user", "content": FIRST}]
    assert first_reply == reference_chat(live_server, history)
    history += [
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": SECOND},
    ]
    with_history = reference_chat(live_server, history)
    without = reference_chat(live_server, [{"role": "user", "content": SECOND}])
    assert with_history != without, "the inputs must make the history matter"
    assert second_reply == with_history


def test_chat_exit_command_and_system_prompt(live_server, monkeypatch, capsys):
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    lines = iter(["", FIRST, "/exit", "never read"])
    code = chat_main(
        live_server.url,
        system="You are terse.",
        max_tokens=MAX_TOKENS,
        temperature=0,
        read_line=lambda prompt: next(lines),
    )
    assert code == 0
    assert next(lines) == "never read"
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": FIRST},
    ]
    assert capsys.readouterr().out == reference_chat(live_server, messages) + "\n"


def test_chat_session_clear_and_refused_turn(live_server):
    out = io.StringIO()
    client = Client(live_server.url, API_KEY)
    session = ChatSession(client, "tiny", {"max_tokens": MAX_TOKENS, "temperature": 0}, out)
    session.reset("sys")
    session.turn(FIRST)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    # A prompt longer than max_model_len (200) is refused: the history stays as it was.
    with pytest.raises(ClientError, match="400"):
        session.turn("word " * 400)
    assert len(session.messages) == 3
    session.reset("sys")
    assert session.messages == [{"role": "system", "content": "sys"}]


def test_the_reasoning_shows_apart_and_stays_out_of_the_history(monkeypatch):
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"reasoning": "They greet"}}]},
        {"choices": [{"delta": {"reasoning": " me."}}]},
        {"choices": [{"delta": {"content": "Hello!"}}]},
    ]
    monkeypatch.setattr(Client, "_stream", lambda self, path, body: iter(events))
    out = io.StringIO()
    session = ChatSession(Client("http://127.0.0.1:1"), "m", {}, out)
    pieces = list(session.client.stream_chat("m", [], {}))
    assert pieces == [ChatPiece("They greet", True), ChatPiece(" me.", True), ChatPiece("Hello!")]
    assert session.turn("Hi") == "Hello!"
    assert out.getvalue() == f"{THINKING}They greet me.\nHello!\n"  # no colours off a terminal
    assert session.messages[-1] == {"role": "assistant", "content": "Hello!"}


def test_chat_reads_piped_stdin_without_prompts(live_server):
    env = {**os.environ, API_KEY_ENV: API_KEY}
    call = f"chat_main(url={live_server.url!r}, max_tokens={MAX_TOKENS}, temperature=0)"
    result = subprocess.run(
        python_entry(call), input=f"{FIRST}\n", capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    first = reference_chat(live_server, [{"role": "user", "content": FIRST}])
    assert result.stdout == first + "\n"


# ----------------------------------------------------------------------------- complete


def test_complete_streams_what_the_server_completes(live_server, capsys):
    code = complete_main(
        "The quick brown fox", live_server.url, API_KEY, max_tokens=12, temperature=0
    )
    assert code == 0
    text = reference_completion(live_server, "The quick brown fox", 12)
    out = capsys.readouterr().out
    assert out == (text if text.endswith("\n") else text + "\n")


def test_complete_subprocess_uses_the_env_key_and_a_v1_url(live_server):
    env = {**os.environ, API_KEY_ENV: f" {API_KEY} ,other"}
    call = f"complete_main('Hello', url={live_server.url + '/v1/'!r}, max_tokens=5, temperature=0)"
    result = subprocess.run(python_entry(call), capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == reference_completion(live_server, "Hello", 5).rstrip("\n")


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_no_server_is_one_clear_line_and_exit_1(command):
    url = f"http://127.0.0.1:{free_port()}"
    call = f"chat_main(url={url!r})" if command == "chat" else f"complete_main('x', url={url!r})"
    result = subprocess.run(python_entry(call), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: No aioinfer server answers at {url}")
    assert "aioinfer serve" in lines[0]


def test_wrong_api_key_says_what_to_do(live_server, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert complete_main("x", live_server.url, "wrong-key") == 1
    err = capsys.readouterr().err
    assert "refused the API key (401" in err and API_KEY_ENV in err
    assert chat_main(live_server.url, read_line=lambda prompt: "/exit") == 1


def test_unknown_model_is_reported(live_server, capsys):
    assert complete_main("x", live_server.url, API_KEY, model="no-such-model") == 1
    assert "404" in capsys.readouterr().err


def test_sse_parsing_stops_at_done_and_raises_on_error_events():
    lines = [b'data: {"a": 1}\n', b"\n", b": comment\n", b"data: [DONE]\n", b'data: {"b": 2}\n']
    assert list(iter_sse_events(lines)) == [{"a": 1}]
    failing = [b'data: {"error": {"message": "engine died", "code": 500}}\n']
    with pytest.raises(ClientError, match="engine died"):
        list(iter_sse_events(failing))
    with pytest.raises(ClientError, match="not JSON"):
        list(iter_sse_events([b"data: {oops\n"]))


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://host:1/v1", "http://host:1"),
        ("https://host/prefix/v1/", "https://host/prefix"),
    ],
)
def test_normalize_url(url, expected):
    assert normalize_url(url) == expected


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host", "http://"])
def test_bad_urls_are_refused(url):
    with pytest.raises(ClientError, match="--url"):
        normalize_url(url)
