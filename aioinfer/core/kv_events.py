"""The prefix cache's changes as events, in vLLM's shapes, for routers that route on what each
replica holds (llm-d's precise prefix scorer, vllm-router's kv_aware policy): a full block
entered the cache (with its tokens, its parent's hash and its adapter), a block's hash was
dropped (evicted, or the cache reset), every block cleared. The block pool and the KV manager
record them; the engine drains them after each step and publishes them (engine/kv_events.py).

PURE: plain data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A block's hash (core/block_pool.py's BlockHash): a SHA-256 digest.
BlockHash = bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """Events since the last drain, in order."""

    events: list[KVEvent] = field(default_factory=list)

    def drain(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
