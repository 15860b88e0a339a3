"""`aioinfer chat` and `aioinfer complete`: stream text from a running server.

Both talk to the OpenAI-compatible API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`)
of an aioinfer server, or of any server that speaks it, with the standard library only: the
answer is read as server-sent events, one `data: {json}` line per delta, until `data: [DONE]`.

Every failure the user can act on (no server at the URL, a refused API key, a server still
loading its model, a rejected request) becomes a `ClientError` whose message is one line; the
commands print it and exit with code 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from http.client import HTTPException, HTTPResponse
from typing import Any, NamedTuple, TextIO

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "AIOINFER_API_KEY"
EXIT_COMMANDS = ("/exit", "/quit")
CLEAR_COMMAND = "/clear"
PROMPT = ">>> "
COMPLETE_MAX_TOKENS = 256
# Generation may take long; a connect that hangs should not.
READ_TIMEOUT = 600.0
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


class ClientError(Exception):
    """A one-line message for the user; the command exits with code 1."""


class ServerNotRunning(ClientError):
    """Nothing answers at the URL."""


def api_key_from_env() -> str | None:
    """The first key of AIOINFER_API_KEY (the server reads it as a comma-separated list)."""
    keys = [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return keys[0] if keys else None


def normalize_url(url: str) -> str:
    """The server's root URL: `http://host:port`, also when given with a trailing `/v1`."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ClientError(f"--url must look like http://HOST:PORT, got {url!r}")
    path = parsed.path.rstrip("/").removesuffix("/v1")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


@dataclass
class Client:
    """A minimal client of the OpenAI-compatible API (stdlib only)."""

    url: str = DEFAULT_URL
    api_key: str | None = None
    timeout: float = READ_TIMEOUT
    _opener: urllib.request.OpenerDirector = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        host = urllib.parse.urlsplit(self.url).hostname or ""
        # A proxy set in the environment must not swallow requests to this machine.
        handlers = [urllib.request.ProxyHandler({})] if host in _LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)

    # ------------------------------------------------------------------ requests

    def models(self) -> list[str]:
        """The ids of the served models (the first is the default)."""
        with self._open("GET", "/v1/models") as resp:
            body = json.load(resp)
        return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]

    def stream_chat(
        self, model: str, messages: list[dict[str, str]], options: dict[str, Any]
    ) -> Generator[ChatPiece, None, None]:
        """The text deltas of a streamed chat completion: the reasoning (a server with
        --reasoning-parser sends it apart), then the answer."""
        body = {"model": model, "messages": messages, "stream": True, **options}
        for event in self._stream("/v1/chat/completions", body):
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                for key in ("reasoning", "content"):
                    if delta.get(key):
                        yield ChatPiece(delta[key], reasoning=key == "reasoning")

    def stream_completion(
        self, model: str, prompt: str, options: dict[str, Any]
    ) -> Generator[str, None, None]:
        """The text deltas of a streamed (plain) completion."""
        body = {"model": model, "prompt": prompt, "stream": True, **options}
        for event in self._stream("/v1/completions", body):
            for choice in event.get("choices") or []:
                text = choice.get("text")
                if text:
                    yield text

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._open("POST", path, body) as resp:
            try:
                yield from iter_sse_events(resp)
            except (OSError, HTTPException) as exc:
                raise ClientError(f"The connection to {self.url} broke: {exc}") from None

    def _open(self, method: str, path: str, body: dict[str, Any] | None = None) -> HTTPResponse:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            return self._opener.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise ClientError(describe_http_error(self.url, exc.code, exc.read())) from None
        except (urllib.error.URLError, OSError, HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerNotRunning(
                f"No aioinfer server answers at {self.url} ({reason}). Start one with "
                "`aioinfer serve`, or point --url at a running one."
            ) from None


def iter_sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """Parse server-sent events from an iterable of byte lines: the JSON of each `data:` line,
    up to `data: [DONE]`. An event that carries an `error` raises ClientError."""
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data:"):
            continue  # blank separators, comments, other fields
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise ClientError(f"The server sent an event that is not JSON: {data[:80]!r}") from None
        if isinstance(event, dict) and "error" in event:
            raise ClientError(f"The server failed the request: {_error_text(event)}")
        yield event


def describe_http_error(url: str, status: int, body: bytes) -> str:
    """One line for an error response, with what to do about the common ones."""
    try:
        message = _error_text(json.loads(body))
    except ValueError:
        message = body.decode("utf-8", "replace").strip() or "no message"
    if status == 401:
        return (
            f"The server at {url} refused the API key (401: {message}). Pass --api-key or set "
            f"{API_KEY_ENV}."
        )
    if status == 503:
        return f"The server at {url} cannot serve yet (503: {message}). Try again shortly."
    return f"The server at {url} answered {status}: {message}"


def _error_text(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body)


def sampling_options(max_tokens: int | None, temperature: float | None) -> dict[str, Any]:
    """Request fields for the flags that were given; the server's defaults for the rest."""
    options: dict[str, Any] = {}
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    if temperature is not None:
        options["temperature"] = temperature
    return options


def pick_model(client: Client, model: str | None) -> str:
    """`model`, else the server's first model; either way the server is reached once."""
    served = client.models()
    if model:
        return model
    if not served:
        raise ClientError(f"The server at {client.url} lists no model; pass --model.")
    return served[0]


# ----------------------------------------------------------------------------- chat

THINKING = "(thinking) "
_DIM, _PLAIN = "\x1b[2m", "\x1b[0m"


class ChatPiece(NamedTuple):
    text: str
    reasoning: bool = False


@dataclass
class ChatSession:
    """The conversation so far and one turn at a time; `out` receives the streamed reply."""

    client: Client
    model: str
    options: dict[str, Any]
    out: TextIO
    messages: list[dict[str, str]] = field(default_factory=list)

    def reset(self, system: str | None) -> None:
        self.messages = [{"role": "system", "content": system}] if system else []

    def turn(self, text: str) -> str:
        """Send `text`, stream the reply to `out` and keep both in the history.

        A failed request leaves the history as it was. Ctrl-C while the reply streams stops it
        (closing the connection aborts the request on the server); the partial reply is kept.
        """
        self.messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        thinking = False  # the reasoning shows, dimmed on a terminal, before the answer
        stream = self.client.stream_chat(self.model, self.messages, self.options)
        try:
            for piece in stream:
                if piece.reasoning and not thinking:
                    self.out.write(self._style(_DIM) + THINKING)
                elif thinking and not piece.reasoning:
                    self.out.write(self._style(_PLAIN) + "\n")
                thinking = piece.reasoning
                if not piece.reasoning:
                    pieces.append(piece.text)
                self.out.write(piece.text)
                self.out.flush()
        except ClientError:
            self.messages.pop()
            if pieces:
                self.out.write("\n")
            raise
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        finally:
            stream.close()  # closes the connection at once
            if thinking:
                self.out.write(self._style(_PLAIN))
        self.out.write("\n")
        self.out.flush()
        reply = "".join(pieces)
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def _style(self, code: str) -> str:
        return code if self.out.isatty() else ""


def chat_main(
    url: str = DEFAULT_URL,
    api_key: str | None = None,
    model: str | None = None,
    system: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    read_line: Callable[[str], str] | None = None,
) -> int:
    """`aioinfer chat`: an interactive, streaming chat that keeps the history.

    `/exit` (or `/quit`) or Ctrl-D ends it; `/clear` forgets the history. Returns the exit code:
    0 when the user quits, 1 when the server cannot be reached or fails a turn for good.
    """
    interactive = sys.stdin.isatty()
    if read_line is None:
        read_line = _terminal_reader(interactive)
    try:
        client = Client(url, api_key if api_key is not None else api_key_from_env())
        options = sampling_options(max_tokens, temperature)
        session = ChatSession(client, pick_model(client, model), options, sys.stdout)
    except ClientError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    session.reset(system)
    if interactive:
        print(
            f"Chatting with {session.model} at {client.url}. /exit or Ctrl-D quits, /clear "
            "forgets the conversation.",
            file=sys.stderr,
        )
    return _chat_loop(session, system, read_line, PROMPT if interactive else "")


def _chat_loop(
    session: ChatSession, system: str | None, read_line: Callable[[str], str], prompt: str
) -> int:
    while True:
        try:
            text = read_line(prompt)
        except EOFError:
            if prompt:
                print()
            return 0
        except KeyboardInterrupt:
            print()
            return 130
        command = text.strip()
        if not command:
            continue
        if command in EXIT_COMMANDS:
            return 0
        if command == CLEAR_COMMAND:
            session.reset(system)
            continue
        try:
            session.turn(text)
        except ServerNotRunning as exc:
            print(f"Error: {exc}", file=sys.stderr)
            return 1
        except ClientError as exc:
            # The request was refused (too long, bad parameter): the conversation goes on.
            print(f"Error: {exc}", file=sys.stderr)


def _terminal_reader(interactive: bool) -> Callable[[str], str]:
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
    return input


# ----------------------------------------------------------------------------- complete


def complete_main(
    prompt: str,
    url: str = DEFAULT_URL,
    api_key: str | None = None,
    model: str | None = None,
    max_tokens: int | None = COMPLETE_MAX_TOKENS,
    temperature: float | None = None,
    out: TextIO | None = None,
) -> int:
    """`aioinfer complete PROMPT`: stream the completion of one prompt (`-` reads stdin)."""
    out = out or sys.stdout
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        client = Client(url, api_key if api_key is not None else api_key_from_env())
        name = pick_model(client, model)
        last = ""
        for piece in client.stream_completion(
            name, prompt, sampling_options(max_tokens, temperature)
        ):
            out.write(piece)
            out.flush()
            last = piece
    except ClientError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        out.write("\n")
        return 130
    if not last.endswith("\n"):
        out.write("\n")
    out.flush()
    return 0
