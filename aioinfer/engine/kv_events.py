"""The prefix cache's events (core/kv_events.py) published as vLLM publishes its KV events, so
that a router built for vLLM's reads aioinfer's: a ZMQ PUB socket; per step with events, one
message of three frames (the topic, a sequence number as 8 big-endian bytes, a msgpack
payload). The payload is vLLM's KVEventBatch as msgspec encodes it (array-like, tagged):

    [timestamp, [["BlockStored", [hash], parent_hash, token_ids, block_size, lora_id, medium],
                 ["BlockRemoved", [hash], medium], ["AllBlocksCleared"], ...]]

Hashes are SHA-256 digests (bytes), medium is None. A slow subscriber loses messages (the
socket's high-water mark), as with vLLM's publisher without its replay socket."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from aioinfer.config import KVEventsConfig
from aioinfer.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)


def encode(event: KVEvent) -> list[Any]:
    """One event as msgspec's array-like, tagged encoding of vLLM's struct."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                event.block_size, event.lora_id, None]  # fmt: skip
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, None]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ValueError(
                f"kv_events_config needs the pyzmq and msgpack packages ({exc.name} is missing):"
                " pip install pyzmq msgpack"
            ) from None
        self._packb = msgpack.packb
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self._topic = config.topic.encode()
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        self._sequence = 0
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        logger.info("Publishing KV cache events on %s", self.endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = self._packb([time.time(), [encode(e) for e in events]], use_bin_type=True)
        frames = [self._topic, self._sequence.to_bytes(8, "big"), payload]
        self._sequence += 1
        # No room left for a slow subscriber: its loss, never the loop's.
        with contextlib.suppress(self._again):
            self._socket.send_multipart(frames, flags=self._noblock)

    def close(self) -> None:
        self._socket.close()
        self._context.term()
