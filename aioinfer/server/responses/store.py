"""The stored responses of the Responses API (`store`, OpenAI's default), in memory, for
GET /v1/responses/{id}, GET /v1/responses/{id}/input_items and `previous_response_id`; a
restart forgets them all.

Bounded twice: by count (the last `MAX_STORED_RESPONSES`) and by bytes (`MAX_STORED_BYTES`),
the oldest going first. A response's size counts its request body, its output and the size of
the conversation it continues (which it keeps alive), so a long chain is not stored for free.
Responses belong to the API key that made them: another key neither sees nor deletes them.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from typing_extensions import TypedDict

from aioinfer.server.responses.protocol import InputItem, InputMessage, ReasoningItem
from aioinfer.server.responses.render import ResponseObject
from aioinfer.server.serving.context import new_id

if TYPE_CHECKING:
    from aioinfer.server.responses.event_log import EventLog

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 * 1024 * 1024


def owner_of(api_key: str | None) -> bytes | None:
    """Who a response belongs to: a digest of the key that made it (None without keys)."""
    if api_key is None:
        return None
    # A key's bytes that are not UTF-8 arrive as surrogates: hashed as those bytes, as auth's.
    return hashlib.sha256(api_key.encode("utf-8", errors="surrogateescape")).digest()


@dataclass(frozen=True)
class StoredResponse:
    body: ResponseObject
    # The conversation up to and with this response: what a continuation starts from (the
    # earlier responses' items, this one's input, its output as items; not its instructions).
    conversation: tuple[InputItem, ...]
    owner: bytes | None = None
    size: int = 0  # bytes, an estimate from above
    # What GET .../input_items lists: the conversation before this response's output, as
    # JSON items with ids (each keeps the id it was first listed with).
    input_items: tuple[Mapping[str, Any], ...] = ()
    # A streamed background response's events, for GET ?stream=true (None otherwise).
    events: EventLog | None = None


class ResponseStore:
    def __init__(
        self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> bool:
        """Keep `stored`, dropping the oldest as needed; False when it alone is too large."""
        if stored.size > self.max_bytes:
            return False
        self._pop(stored.body["id"])
        self._responses[stored.body["id"]] = stored
        self.total_bytes += stored.size
        while len(self._responses) > self.capacity or self.total_bytes > self.max_bytes:
            self._pop(next(iter(self._responses)))
        return True

    def get(self, response_id: str, owner: bytes | None = None) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, response_id: str, owner: bytes | None = None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        return self._pop(response_id)

    def _pop(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self.total_bytes -= stored.size
        return True


# ---------------------------------------------------------------------- input items

_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


class InputItemList(TypedDict):
    object: Literal["list"]
    data: list[Mapping[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def listed_item(item: InputItem) -> dict[str, Any]:
    """An input item as GET .../input_items shows it, OpenAI's way: with an id (the one it
    came with, or a new one) and a message's text as content parts."""
    fields = item.model_dump(exclude_none=True)
    item_id = fields.pop("id", None) or new_id(_ID_PREFIXES[item.type])
    if isinstance(item, InputMessage):
        parts = fields["content"]
        if isinstance(parts, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            parts = [{"type": kind, "text": parts}]
        fields["content"] = [
            {**part, "annotations": []} if part["type"] == "output_text" else part for part in parts
        ]
    if not isinstance(item, ReasoningItem):
        fields["status"] = "completed"
    return {"id": item_id, **fields}


def input_item_page(
    items: Sequence[Mapping[str, Any]],
    limit: int = 20,
    ascending: bool = False,
    after: str | None = None,
    before: str | None = None,
) -> InputItemList:
    """One page of a response's input items, newest first unless `ascending`; `after` and
    `before` are item ids of the same order (cursors). Raises KeyError naming the cursor
    whose id is not among the items."""
    ordered = list(items) if ascending else list(reversed(items))
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is None:
            continue
        if cursor not in ids:
            raise KeyError(name)
        if name == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    window = ordered[start:end]
    data = window[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(window) > limit,
    }
