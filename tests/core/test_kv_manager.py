from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.request import Request
from aioinfer.core.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), max_tokens=16)


def admit(kv: KVCacheManager, req: Request) -> list[int] | None:
    """What the scheduler does for a new request: prefix lookup, then allocate the rest."""
    cached, num_hit = kv.find_cached_prefix(req)
    table = kv.allocate(req, req.num_tokens - num_hit, cached)
    if table is not None:
        req.num_computed_tokens = req.num_tokens
    return table


def test_allocate_exact_blocks_and_growth():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert admit(kv, req) == [1, 2, 3]
    req.append_output(99)
    req.append_output(98)  # 12 tokens: still 3 blocks
    assert kv.allocate(req, 1) == [1, 2, 3]
    req.num_computed_tokens = 11
    req.num_computed_tokens = 12
    assert kv.allocate(req, 1) == [1, 2, 3, 4]  # token 13 needs a 4th block
    kv.check_integrity()


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(9)))
    assert admit(kv, a) == [1, 2, 3]
    b = make_request("b", [*range(8), 100, 101])
    cached, num_hit = kv.find_cached_prefix(b)
    assert (cached, num_hit) == ([1, 2], 8)
    assert kv.allocate(b, 2, cached) == [1, 2, 4]
    assert kv.pool.ref_counts[1:5] == [2, 2, 1, 1]
    # A prompt fully in the cache still computes its last token: only 1 block of 2 is a hit.
    c = make_request("c", list(range(8)))
    assert kv.find_cached_prefix(c) == ([1], 4)
    kv.check_integrity()


def test_a_cache_salt_shares_prefixes_only_within_itself():
    """vLLM's cache_salt: one tenant cannot hit (or time) another's cached prompt, nor an
    unsalted one, nor can an empty salt or one that spells another tag."""
    kv = KVCacheManager(num_blocks=20, block_size=4)
    tokens = list(range(9))
    first = make_request("a", tokens)
    first.cache_salt = "tenant-1"
    assert admit(kv, first) == [1, 2, 3]
    for rid, salt, hit in (("b", "tenant-1", 8), ("c", "tenant-2", 0), ("d", None, 0)):
        other = make_request(rid, tokens)
        other.cache_salt = salt
        assert kv.find_cached_prefix(other)[1] == hit, salt
    unsalted = make_request("e", tokens)
    assert admit(kv, unsalted) == [4, 5, 6]
    for salt in ("", "x", "tenant-1 ", "lora:0"):
        posing = make_request(f"f{salt}", tokens)
        posing.cache_salt = salt
        assert kv.find_cached_prefix(posing)[1] == 0, salt
    kv.check_integrity()


def test_free_returns_tail_first_and_cached_blocks_survive_for_later_hits():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(kv, a) == [1, 2, 3]
    kv.free(a)
    kv.free(a)  # idempotent
    # Block 3 holds one token: uncached, so it is evicted first; cached tail 2 before head 1.
    assert list(kv.pool.free_queue) == [3, 4, 5, 2, 1]
    b = make_request("b", [1, 2, 3, 4, 9])
    assert admit(kv, b) == [1, 2, 3]
    kv.check_integrity()


def test_reset_prefix_cache_only_when_no_request_holds_a_block():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    assert kv.reset_prefix_cache() is False  # a holds its blocks
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 9]))[1] == 4
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.find_cached_prefix(make_request("c", [1, 2, 3, 4, 9])) == ([], 0)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    kv.check_integrity()


def test_allocate_fails_without_side_effects_when_the_pool_is_full():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(12)))
    assert admit(kv, a) == [1, 2, 3]
    b = make_request("b", [5])
    assert admit(kv, b) is None
    assert "b" not in kv.block_tables
    kv.check_integrity()


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    b = make_request("b", [1, 2, 3, 4, 5], prompt_logprobs=1)
    assert kv.find_cached_prefix(b) == ([], 0)


def test_skip_reading_prefix_cache_computes_every_prompt_token():
    """vLLM's SamplingParams.skip_reading_prefix_cache: True skips the cached prefix that the
    same prompt would otherwise take; False and None (without prompt logprobs) take it."""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    admit(kv, make_request("a", [1, 2, 3, 4, 5]))
    skipping = make_request("b", [1, 2, 3, 4, 5], skip_reading_prefix_cache=True)
    assert kv.find_cached_prefix(skipping) == ([], 0)
    for i, flag in enumerate((False, None)):
        reading = make_request(f"c{i}", [1, 2, 3, 4, 5], skip_reading_prefix_cache=flag)
        assert kv.find_cached_prefix(reading)[1] == 4


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "free"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 3), min_size=1, max_size=12),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(2, 12))
def test_random_operations_keep_the_pool_consistent(ops, block_size, num_blocks):
    """Random allocate / append / free / prefix-hit sequences: integrity holds after every
    operation, and the pool is fully free at the end. Small token alphabets force prefix hits."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    live: dict[int, Request] = {}
    serial = 0
    for op, slot, tokens in ops:
        if op == "new" and slot not in live:
            serial += 1
            req = make_request(f"r{serial}", tokens)
            if admit(kv, req) is not None:
                live[slot] = req
        elif op == "append" and slot in live:
            req = live[slot]
            for t in tokens[:3]:
                req.append_output(t)
            if kv.allocate(req, req.num_tokens - req.num_computed_tokens) is None:
                kv.free(live.pop(slot))  # what preemption does
            else:
                req.num_computed_tokens = req.num_tokens
        elif op == "free" and slot in live:
            kv.free(live.pop(slot))
        kv.check_integrity()
        expected_used = sum(len(kv.block_table(r.request_id)) for r in live.values())
        assert sum(kv.pool.ref_counts[1:]) == expected_used
    for req in live.values():
        kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == num_blocks - 1
    assert kv.usage == 0.0


# Two 16-token blocks whose Python tuple hashes are equal, found by a birthday search on CPython's
# unkeyed tuple hash (about 20 s on two cores): a cache keyed by that hash served B's request
# with A's KV.
COLLIDING_A = [23815, 622, *range(1074, 1519, 37), 100]
COLLIDING_B = [14513, 34, *range(1074, 1519, 37), 8825]


def test_crafted_tuple_hash_collision_is_not_a_prefix_hit():
    assert hash(tuple(COLLIDING_A)) == hash(tuple(COLLIDING_B))  # the attack's precondition
    kv = KVCacheManager(num_blocks=8, block_size=16)
    a = make_request("a", [*COLLIDING_A, 1, 2])
    assert admit(kv, a) is not None
    b = make_request("b", [*COLLIDING_B, 1, 2])
    cached, num_hit = kv.find_cached_prefix(b)
    assert (cached, num_hit) == ([], 0)
    same = make_request("c", [*COLLIDING_A, 3])
    assert kv.find_cached_prefix(same)[1] == 16  # the real prefix still hits
