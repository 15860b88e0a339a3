"""The state the handlers of one app share: the engine once it serves, the config, the disconnect
watcher, the metrics and the shutdown flags. An API's own state (the Responses API's stored
responses) lives in an app key of its package."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from aioinfer.config import ServerConfig
from aioinfer.server.http.errors import ServiceUnavailableError
from aioinfer.server.http.metrics import ServerMetrics
from aioinfer.server.http.sse import DisconnectWatcher

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


@dataclass
class ServerState:
    """What the handlers share; lives in `app[STATE]`."""

    config: ServerConfig
    watcher: DisconnectWatcher = field(default_factory=DisconnectWatcher)
    engine: AsyncEngine | None = None
    startup_error: BaseException | None = None
    draining: bool = False
    # Told to stop, serving on through --shutdown-notice: /health answers 503 already.
    leaving: bool = False
    in_flight: int = 0  # generation requests being answered; shutdown waits for them
    created: int = field(default_factory=lambda: int(time.time()))
    # Set once the engine serves, or failed to start.
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    metrics: ServerMetrics = field(init=False)
    # (request kind, field) pairs already logged as ignored: each is logged once.
    ignored_fields_logged: set[tuple[str, str]] = field(default_factory=set)
    _token_texts: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(
            lambda: self.engine, self.config.metrics_prefix, self.config.lora_names_in_metrics
        )

    def set_engine(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._token_texts.clear()
        self.ready.set()

    def set_startup_error(self, error: BaseException) -> None:
        self.startup_error = error
        self.ready.set()

    def unavailable_reason(self) -> str | None:
        """Why the server cannot take requests now, or None when it can."""
        if self.draining:
            return "The server is shutting down"
        if self.startup_error is not None:
            return f"The engine failed to start: {self.startup_error!r}"
        if self.engine is None or not self.engine.ready:
            return "The engine is loading; retry when /health answers 200"
        if self.engine.dead_error is not None:
            return f"The engine failed: {self.engine.dead_error!r}"
        return None

    def serving_engine(self) -> AsyncEngine:
        reason = self.unavailable_reason()
        if reason is not None:
            raise ServiceUnavailableError(reason, headers={"Retry-After": "5"})
        assert self.engine is not None
        return self.engine

    def token_text(self, tokenizer: Any) -> Callable[[int], str]:
        """Decoded text of one token id, cached (logprobs ask for the same ids again and again)."""
        cache = self._token_texts

        def text(token_id: int) -> str:
            value = cache.get(token_id)
            if value is None:
                value = tokenizer.decode([token_id], skip_special_tokens=False)
                # SentencePiece decoders drop a word's leading space ("▁") at the start of a
                # text: alone, every token is at the start. Keep it, as the token adds it.
                piece = tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and piece.startswith("\u2581") and value[:1] != " ":
                    value = " " + value
                cache[token_id] = value
            return value

        return text

    def token_bytes(self, tokenizer: Any) -> Callable[[int], list[int]]:
        """The bytes of one token id (see `engine.tokenizer.token_bytes`)."""
        from aioinfer.engine.tokenizer import token_bytes

        text = self.token_text(tokenizer)
        return lambda token_id: list(token_bytes(tokenizer, token_id, text(token_id)))


STATE = web.AppKey("aioinfer_state", ServerState)
