"""The stored responses of the Responses API (`store`, OpenAI's default), in memory, for
GET /v1/responses/{id}, GET /v1/responses/{id}/input_items and `previous_response_id`; a
restart forgets them all.

Bounded twice: by count (the last `MAX_STORED_RESPONSES`) and by bytes (`MAX_STORED_BYTES`),
the oldest going first. A response is kept as compact JSON bytes (the response, its whole
conversation, its listed input items) and rebuilt when it is read or continued, so its size is
what it holds: those bytes, a streamed background response's events, and a fixed allowance for
the objects around them. (Kept as pydantic models and dicts, 100,000 small items held about 11
times what their request's bytes counted.) A long chain is not stored for free: each response
holds its whole conversation. Responses belong to the API key that made them: another key
neither sees nor deletes them.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import orjson
from typing_extensions import TypedDict

from aioinfer.server.responses.protocol import (
    INPUT_ITEMS,
    InputItem,
    InputMessage,
    ReasoningItem,
)
from aioinfer.server.responses.render import ResponseObject
from aioinfer.server.serving.context import new_id

if TYPE_CHECKING:
    from aioinfer.server.responses.event_log import EventLog

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 * 1024 * 1024
# What a stored response holds besides its bytes: the StoredResponse, its bytes objects and
# its places in the store's dict, from above.
STORED_OVERHEAD = 1024
EMPTY = b"[]"


def owner_of(api_key: str | None) -> bytes | None:
    """Who a response belongs to: a digest of the key that made it (None without keys)."""
    if api_key is None:
        return None
    # A key's bytes that are not UTF-8 arrive as surrogates: hashed as those bytes, as auth's.
    return hashlib.sha256(api_key.encode("utf-8", errors="surrogateescape")).digest()


@dataclass(frozen=True)
class StoredResponse:
    """A response as kept: JSON bytes, rebuilt by the properties and `conversation()`."""

    response_id: str
    status: str
    body_json: bytes
    # The conversation up to and with this response: what a continuation starts from (the
    # earlier responses' items, this one's input, its output as items; not its instructions),
    # a JSON array of input items.
    conversation_json: bytes = EMPTY
    owner: bytes | None = None
    # What GET .../input_items lists: the conversation before this response's output, as a
    # JSON array of items with ids (each keeps the id it was first listed with).
    input_items_json: bytes = EMPTY
    # A streamed background response's events, for GET ?stream=true (None otherwise).
    events: EventLog | None = None

    @classmethod
    def of(
        cls,
        body: ResponseObject,
        conversation_json: bytes = EMPTY,
        owner: bytes | None = None,
        input_items_json: bytes = EMPTY,
        events: EventLog | None = None,
    ) -> StoredResponse:
        return cls(
            body["id"], body["status"], exact(orjson.dumps(body)), conversation_json, owner,
            input_items_json, events,
        )  # fmt: skip

    @property
    def size(self) -> int:
        """The bytes it holds, from above: its JSON, its events (those of a stream still
        being generated grow until it is stored again), and the objects around them."""
        events = self.events.nbytes if self.events is not None else 0
        held = len(self.body_json) + len(self.conversation_json) + len(self.input_items_json)
        return held + events + STORED_OVERHEAD

    @property
    def body(self) -> ResponseObject:
        return cast(ResponseObject, orjson.loads(self.body_json))

    def conversation(self) -> list[InputItem]:
        return INPUT_ITEMS.validate_json(self.conversation_json)

    def input_items(self) -> list[dict[str, Any]]:
        return cast("list[dict[str, Any]]", orjson.loads(self.input_items_json))


def exact(data: bytes) -> bytes:
    """A copy of `data` that holds its length and no more: orjson leaves the room it grew
    into behind its output (385 KB of JSON held 1 MB)."""
    return bytes(memoryview(data))


def dump_items(items: Sequence[InputItem]) -> bytes:
    """Input items as a compact JSON array that `StoredResponse.conversation` reads back."""
    return INPUT_ITEMS.dump_json(list(items), exclude_none=True)


def joined(*arrays: bytes) -> bytes:
    """One JSON array of the items of several (compact, as orjson and pydantic write them)."""
    parts = [a[1:-1] for a in arrays if a != EMPTY]
    return b"[" + b",".join(parts) + b"]"


class ResponseStore:
    def __init__(
        self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # as counted when stored

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> bool:
        """Keep `stored`, dropping the oldest as needed; False when it alone is too large."""
        size = stored.size
        if size > self.max_bytes:
            return False
        self._pop(stored.response_id)
        self._responses[stored.response_id] = stored
        self._sizes[stored.response_id] = size
        self.total_bytes += size
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
        self.total_bytes -= self._sizes.pop(response_id)
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
