"""The stored responses of the Responses API (`store`, OpenAI's default): the last
`MAX_STORED_RESPONSES` of them, in memory, for GET /v1/responses/{id} and for
`previous_response_id`. The oldest goes first when the store is full, so memory stays bounded
by the count (each response at most a context's worth of text); a restart forgets them all.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from aioinfer.server.responses_protocol import InputItem
from aioinfer.server.responses_render import ResponseObject

MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    body: ResponseObject
    # The conversation up to and with this response: what a continuation starts from (the
    # earlier responses' items, this one's input, its output as items; not its instructions).
    conversation: tuple[InputItem, ...]


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.body["id"]] = stored
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
