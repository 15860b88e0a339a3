"""The prefix cache's events (--kv-events-config): recorded where blocks enter and leave the
cache, and published as vLLM publishes its KV events, so that a router built for vLLM's (llm-d,
vllm-router's kv_aware policy) can read them. A subscriber here decodes them."""

from __future__ import annotations

import asyncio

import pytest

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from aioinfer.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.request import Request
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.async_engine import AsyncEngine
from tests.engine.test_engine import FakeRunnerFactory
from tests.support.tokenizers import make_tokenizer

BS = 4


def request(rid: str, prompt: list[int], lora_slot: int = 0) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=4), max_tokens=4)
    r.lora_slot = lora_slot
    return r


def test_stored_removed_and_cleared_are_recorded_where_they_happen():
    log = KVEventLog()
    kv = KVCacheManager(num_blocks=5, block_size=BS, events=log)  # 4 usable blocks
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks
    a = request("a", prompt)
    assert kv.allocate(a, len(prompt)) is not None
    stored = log.drain()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    first, second = stored
    assert first.token_ids == prompt[:BS] and first.parent_block_hash is None
    assert second.token_ids == prompt[BS : 2 * BS]
    assert second.parent_block_hash == first.block_hashes[0]
    assert a.block_hashes[:2] == [first.block_hashes[0], second.block_hashes[0]]
    assert first.block_size == BS and first.lora_id is None
    # The same prefix again is a hit: nothing new enters the cache.
    b = request("b", prompt)
    blocks, hit = kv.find_cached_prefix(b)
    kv.allocate(b, len(prompt) - hit, blocks)
    assert log.drain() == []
    kv.free(a)
    kv.free(b)
    # A request that needs every block evicts the cached ones: their hashes go.
    c = request("c", list(range(100, 116)), lora_slot=3)
    kv.allocate(c, 16)
    events = log.drain()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert {h for e in removed for h in e.block_hashes} == set(a.block_hashes[:2])
    assert [e.lora_id for e in events if isinstance(e, BlockStored)] == [3, 3, 3, 3]
    kv.free(c)
    assert kv.reset_prefix_cache()
    assert log.drain() == [AllBlocksCleared()]


async def test_an_engine_publishes_them_over_zmq_as_vllm_does():
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    config = CacheConfig(
        block_size=BS,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                          "topic": "kv@pod-1@fake"},
    )  # fmt: skip
    engine = await AsyncEngine.create(
        ModelConfig(model="fake"), config, SchedulerConfig(max_num_batched_tokens=32),
        runner_factory=FakeRunnerFactory(), tokenizer=make_tokenizer(),
    )  # fmt: skip
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    try:
        assert engine.kv_event_publisher is not None
        socket.connect(engine.kv_event_publisher.endpoint)
        socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        await asyncio.sleep(0.3)  # a PUB socket drops what it sends before the SUB joins
        prompt = list(range(20, 33))  # 13 tokens: 3 full blocks
        stream = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while not (await stream.get()).finished:
            pass
        topic, sequence, payload = await asyncio.to_thread(socket.recv_multipart)
    finally:
        socket.close()
        context.term()
        await engine.shutdown()
    assert topic == b"kv@pod-1@fake" and int.from_bytes(sequence, "big") == 0
    timestamp, events = msgpack.unpackb(payload, raw=False)
    assert isinstance(timestamp, float)
    stored = [e for e in events if e[0] == "BlockStored"]
    assert [e[3] for e in stored] == [prompt[0:4], prompt[4:8], prompt[8:12]]
    hashes = [e[1][0] for e in stored]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert [e[2] for e in stored] == [None, hashes[0], hashes[1]]  # each block's parent
    assert all(e[4] == BS and e[5] is None and e[6] is None for e in stored)
