"""Per-request block tables over the block pool, with prefix caching."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from aioinfer.core.block_pool import BlockPool, hash_block
from aioinfer.core.kv_events import BlockStored, KVEventLog
from aioinfer.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens, like vLLM's prefix_cache_queries / prefix_cache_hits."""

    queries: int = 0
    hits: int = 0
    num_requests: int = 0

    def record(self, num_queried: int, num_hit: int) -> None:
        """Count one lookup of a request admitted for the first time."""
        self.queries += num_queried
        self.hits += num_hit
        self.num_requests += 1


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ):
        """`events`: where the prefix cache's changes are recorded (core/kv_events.py)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks, events)
        self.events = events
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already in the prefix map
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's, e.g. between benchmark runs); only while no
        request holds a block. Returns whether it did."""
        if self.block_tables:
            return False
        self.pool.reset_prefix_cache()
        return True

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def uses_prefix_cache(self, request: Request) -> bool:
        """Whether the request's prefix is looked up in the cache and its blocks added to it."""
        return self.enable_prefix_caching and not request.skips_prefix_cache

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks that hold a prefix of a new request's tokens, and how many tokens
        they cover. At least one token is always left to compute, since its logits are needed.
        Mutates nothing but the request's hash list."""
        if not self.uses_prefix_cache(request):
            return [], 0
        self._extend_hashes(request, request.num_tokens)
        blocks: list[int] = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and the
        cached prefix blocks of a new request). Returns the request's whole block table, or None,
        changing nothing, when the pool has too few free blocks."""
        cached_blocks = cached_blocks or []
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(table) - len(cached_blocks)
        # Cached blocks nobody references sit in the free queue: taking them uses up free room.
        num_cached_free = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + num_cached_free > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request.request_id]
            return None
        self.pool.touch(cached_blocks)
        table.extend(cached_blocks)
        if num_new_blocks > 0:
            new_blocks = self.pool.allocate(num_new_blocks)
            assert new_blocks is not None  # checked above
            table.extend(new_blocks)
        self._cache_full_blocks(request, table, num_computed + num_new_tokens)
        return table

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first so its tail is evicted before its head.
        Idempotent: a request without blocks is a no-op."""
        table = self.block_tables.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def check_integrity(self) -> None:
        used: dict[int, int] = {}
        for table in self.block_tables.values():
            for block in table:
                used[block] = used.get(block, 0) + 1
        self.pool.check_integrity(used)

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Hash each full block of the request's first num_tokens tokens not hashed yet."""
        hashes, bs = request.block_hashes, self.block_size
        if len(hashes) >= num_tokens // bs:
            return
        # A LoRA adapter, or LongRoPE's long factors, change every K/V, and a cache salt keeps
        # one tenant's prefixes from another's: such requests' chains start from their own root,
        # a digest like any parent's. The salt comes last, after tags it cannot begin with.
        tags = [f"lora:{request.lora_slot}"] if request.lora_slot else []
        if request.long_rope:
            tags.append("rope:long")
        if request.cache_salt is not None:
            tags.append(f"salt:{request.cache_salt}")
        root = hashlib.sha256(" ".join(tags).encode()).digest() if tags else None
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, request.all_token_ids[i * bs : (i + 1) * bs]))

    def _cache_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        # The K/V of these tokens are written by the step being planned, before any later step
        # can read them, so the blocks may be shared from the next step on. Drafted tokens
        # (past the request's own) are not known to be right yet: their blocks wait.
        if not self.uses_prefix_cache(request):
            return
        num_tokens = min(num_tokens, request.num_tokens)
        self._extend_hashes(request, num_tokens)
        first = self.num_cached_blocks.get(request.request_id, 0)
        last = num_tokens // self.block_size
        hashes = request.block_hashes
        for i in range(first, last):
            if self.pool.cache(table[i], hashes[i]) and self.events is not None:
                tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
                self.events.events.append(
                    BlockStored(
                        [hashes[i]],
                        hashes[i - 1] if i else None,
                        list(tokens),
                        self.block_size,
                        request.lora_slot or None,
                    )
                )
        self.num_cached_blocks[request.request_id] = max(first, last)
