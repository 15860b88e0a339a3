"""The pool of paged KV-cache blocks: integer ids, reference counts, a free queue, a prefix map.

Block 0 is reserved as the null block (padding writes land there) and is never handed out.

Free queue, front to back = first evicted to last evicted:

    [ uncached blocks ... | cached blocks, least recently freed ... most recently freed ]

A free block that holds a cached hash stays findable by `lookup` until it is evicted: taken from
the front of the queue by `allocate`, which then drops its hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from aioinfer.core.kv_events import AllBlocksCleared, BlockRemoved, KVEventLog

NULL_BLOCK = 0

BlockHash = bytes


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of a full block: it chains the parent's hash, so equal hashes mean equal prefixes.

    SHA-256, because a cache hit trusts the hash alone: Python's own tuple hash is unkeyed and a
    client can craft two blocks that share it in seconds, then be served another prompt's KV.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        """`events`: where the prefix cache's changes are recorded (None: nowhere)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.ref_counts[NULL_BLOCK] = 1  # never freed, never evicted
        self.events = events

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks from the front of the free queue (ref count 1). None if fewer are free."""
        if n > len(self.free_queue):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._drop_hash(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each block (prefix hits); free ones leave the free queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given: the caller passes a request's
        blocks tail first, so its tail is evicted before its head. Blocks that reach zero join
        the queue: uncached ones at the front (nothing to keep), cached ones at the back."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hashes[block] is None:
                    self.free_queue.move_to_end(block, last=False)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Record that a full block holds the tokens behind block_hash; whether it did. A hash
        that another block already holds keeps its first block (the duplicate just stays
        uncached)."""
        if self.block_hashes[block] is not None or block_hash in self.cached:
            return False
        self.block_hashes[block] = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after the KV tensors were reallocated)."""
        for block in list(self.cached.values()):
            self._drop_hash(block, report=False)
        if self.events is not None:
            self.events.events.append(AllBlocksCleared())

    def _drop_hash(self, block: int, report: bool = True) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block] = None
            if report and self.events is not None:
                self.events.events.append(BlockRemoved([block_hash]))

    def check_integrity(self, used: dict[int, int]) -> None:
        """Raise AssertionError unless every block is free xor referenced exactly `used[b]` times.

        `used` counts, per block, how many block tables hold it (the KV manager supplies it).
        """
        problems = []
        for block in range(1, self.num_blocks):
            refs, in_queue = self.ref_counts[block], block in self.free_queue
            if refs != used.get(block, 0):
                problems.append(f"block {block}: ref count {refs}, used {used.get(block, 0)}")
            if (refs == 0) != in_queue:
                problems.append(f"block {block}: ref count {refs} but in free queue={in_queue}")
        for block_hash, block in self.cached.items():
            if self.block_hashes[block] != block_hash:
                problems.append(f"block {block}: prefix map and block hash disagree")
        if self.ref_counts[NULL_BLOCK] != 1 or NULL_BLOCK in self.free_queue:
            problems.append("null block was handed out")
        if problems:
            raise AssertionError("; ".join(problems))
