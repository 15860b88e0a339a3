"""The Responses API's state in one app: its stored responses and the background responses
being generated. The app creates it (`app[RESPONSES]`); its handlers read it from there."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from aioinfer.server.responses.store import ResponseStore

# Background responses one API key may have being generated at once (without keys, the whole
# server): each goes on whatever its client does, so one client could otherwise queue any
# number of them.
MAX_BACKGROUND_PER_KEY = 64


@dataclass(frozen=True)
class BackgroundResponse:
    """The task generating a background response, and the API key it belongs to."""

    task: asyncio.Task[None]
    owner: bytes | None


@dataclass
class ResponsesState:
    store: ResponseStore = field(default_factory=ResponseStore)
    # Background responses being generated, by id (POST /v1/responses/{id}/cancel stops them).
    background: dict[str, BackgroundResponse] = field(default_factory=dict)


RESPONSES = web.AppKey("aioinfer_responses", ResponsesState)
