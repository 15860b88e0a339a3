from __future__ import annotations

import pytest

from aioinfer.core.block_pool import NULL_BLOCK, BlockPool, hash_block


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def test_allocate_takes_from_the_front_and_reserves_the_null_block():
    pool = BlockPool(6)
    assert free_order(pool) == [1, 2, 3, 4, 5]
    assert pool.allocate(2) == [1, 2]
    assert pool.ref_counts == [1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(2 / 5)
    assert NULL_BLOCK not in free_order(pool)


def test_allocate_returns_none_and_changes_nothing_when_short():
    pool = BlockPool(4)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(1) is None
    assert pool.ref_counts == [1, 1, 1, 1]


def test_free_puts_uncached_blocks_first_and_cached_blocks_last_in_the_given_order():
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    assert blocks == [1, 2, 3, 4]
    pool.cache(1, hash_block(None, [1, 2]))
    pool.cache(2, hash_block(pool.block_hashes[1], [3, 4]))
    # A request frees tail first: 4, 3 (uncached) go to the front, 2 then 1 to the back.
    pool.free(reversed(blocks))
    assert free_order(pool) == [3, 4, 5, 2, 1]
    # Eviction takes uncached first, then the cached tail (2) before the cached head (1).
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert pool.lookup(pool.block_hashes[1]) == 1
    assert pool.block_hashes[2] is None  # evicted: its hash is gone


def test_touch_revives_a_cached_free_block_and_shares_it():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    h = hash_block(None, [7, 7])
    pool.cache(b, h)
    pool.free([b])
    assert pool.lookup(h) == b and b in pool.free_queue
    pool.touch([b])
    pool.touch([b])
    assert pool.ref_counts[b] == 2 and b not in pool.free_queue
    pool.free([b])
    assert pool.ref_counts[b] == 1 and b not in pool.free_queue
    pool.check_integrity({b: 1})


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h = hash_block(None, [1])
    pool.cache(a, h)
    pool.cache(b, h)
    assert pool.lookup(h) == a
    assert pool.block_hashes[b] is None


def test_hash_chain_depends_on_the_parent():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(hash_block(None, [1]), [2]) != hash_block(hash_block(None, [3]), [2])


def test_integrity_check_catches_a_wrong_ref_count():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.check_integrity({1: 1, 2: 1})
    with pytest.raises(AssertionError, match="block 2"):
        pool.check_integrity({1: 1})


def test_double_free_raises():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])
