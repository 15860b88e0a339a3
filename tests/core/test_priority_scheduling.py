"""--scheduling-policy priority: the waiting queue ordered by (priority, arrival), preemption of
the running request with the largest key, and exact outputs whatever the order."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioinfer.config import SchedulerConfig, ServerConfig
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.request import Request
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.scheduler import PriorityQueue, Scheduler
from aioinfer.server.app import create_app
from tests.core.test_scheduler import run_to_completion
from tests.engine.test_engine import FakeRunnerFactory, fake_llm
from tests.server.conftest import build_engine
from tests.server.test_http import error_of, post
from tests.support.fake_runner import FakeRunner, reference_output


def engine(num_blocks=64, max_num_seqs=8, budget=32, policy="priority"):
    kv = KVCacheManager(num_blocks, 4)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy)
    return sched, FakeRunner(num_blocks, 4)


def request(rid, prompt, priority, arrival, max_tokens=4):
    return Request(rid, prompt, SamplingParams(ignore_eos=True), max_tokens=max_tokens,
                   arrival_time=arrival, priority=priority)  # fmt: skip


def admission_order(sched: Scheduler, runner: FakeRunner) -> list[str]:
    order: list[str] = []
    while sched.has_work():
        plan = sched.schedule()
        order += [c.request_id for c in plan.chunks if c.start_pos == 0]
        sched.apply(plan, runner.execute(plan))
    return order


def test_waiting_requests_run_by_priority_then_arrival():
    sched, runner = engine(max_num_seqs=1)
    for rid, priority, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)]:
        sched.add(request(rid, [5, 6, 7], priority, arrival))
    assert admission_order(sched, runner) == ["b", "d", "c", "a"]
    fifo, runner = engine(max_num_seqs=1, policy="fcfs")
    for rid, priority, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0)]:
        fifo.add(request(rid, [5, 6, 7], priority, arrival))
    assert admission_order(fifo, runner) == ["a", "b", "c"]


@pytest.mark.parametrize(("policy", "victim"), [("priority", "bulk"), ("fcfs", "normal")])
def test_the_running_request_with_the_largest_key_is_preempted(policy, victim):
    """Three requests start one after the other and fill the pool: the low-priority one is
    preempted though it is not the newest (first come, first served takes the newest), and
    every output stays exact."""
    # 9 usable blocks of 4 tokens: 8-token prompts, 8 tokens out each.
    sched, runner = engine(num_blocks=10, budget=64, policy=policy)
    priorities = {"urgent": 0, "bulk": 9, "normal": 1}
    requests = {}
    outputs: dict[str, list[int]] = {}
    for arrival, (rid, priority) in enumerate(priorities.items()):
        requests[rid] = request(rid, [5 + arrival] * 8, priority, float(arrival), max_tokens=8)
        sched.add(requests[rid])
        plan = sched.schedule()  # each starts alone, in turn
        for update in sched.apply(plan, runner.execute(plan)):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    for rid, tokens in run_to_completion(sched, runner)[0].items():
        outputs.setdefault(rid, []).extend(tokens)
    assert [rid for rid, r in requests.items() if r.num_preemptions] == [victim]
    for rid, r in requests.items():
        assert outputs[rid] == reference_output(list(r.prompt_token_ids), 8)


def test_a_low_priority_request_that_started_first_is_the_one_preempted():
    """Running requests take their shares of a step in priority order, so the one that runs
    short of blocks is never preempted for a request of a larger key."""
    sched, runner = engine(num_blocks=10, budget=64)  # 9 usable blocks of 4 tokens
    low = request("low", [5] * 8, 9, 0.0, max_tokens=12)
    sched.add(low)
    plan = sched.schedule()
    sched.apply(plan, runner.execute(plan))
    high = request("high", [6] * 8, 0, 1.0, max_tokens=12)
    sched.add(high)
    run_to_completion(sched, runner)
    assert (high.num_preemptions, low.num_preemptions > 0) == (0, True)


def test_a_request_the_queue_refuses_is_not_left_in_the_scheduler():
    sched, runner = engine()
    sched.add(request("a", [5, 6, 7], 1, 0.0))
    with pytest.raises(TypeError):
        sched.add(request("b", [5, 6, 7], None, 1.0))  # cannot be ordered against 1
    assert list(sched.requests) == ["a"]
    assert admission_order(sched, runner) == ["a"]


def test_the_priority_queue_keeps_its_order_through_removals_and_returns():
    queue = PriorityQueue()
    requests = [request(f"r{i}", [5], p, float(i)) for i, p in enumerate([3, 1, 3, 0, 1])]
    for r in requests:
        queue.append(r)
    assert [r.request_id for r in queue] == ["r3", "r1", "r4", "r0", "r2"]
    queue.remove(requests[4])
    first = queue.popleft()
    assert first.request_id == "r3" and len(queue) == 3
    queue.appendleft(first)  # a preempted request goes back to its place: the front here
    queue.appendleft(requests[4])
    assert [r.request_id for r in queue] == ["r3", "r1", "r4", "r0", "r2"]
    assert queue[0] is first


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.sampled_from([12, 20, 64]))
def test_random_priorities_finish_exactly_and_leave_no_block(seed, num_blocks):
    rng = random.Random(seed)
    sched, runner = engine(num_blocks=num_blocks, budget=rng.choice([8, 32]))
    expected = {}
    for i in range(8):
        prompt = [rng.randrange(2, 50) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, 12)
        sched.add(request(f"r{i}", prompt, rng.randint(-2, 2), float(i), max_tokens))
        expected[f"r{i}"] = reference_output(prompt, max_tokens)
    outputs, _ = run_to_completion(sched, runner)
    assert outputs == expected
    assert sched.kv.pool.num_free_blocks == num_blocks - 1


def test_the_policy_is_checked():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="policy must be"):
        engine(policy="lifo")


# ----------------------------------------------------------------------------- engine, LLM, HTTP


def test_the_offline_llm_takes_a_priority_per_prompt():
    """The one-step budget admits one prompt a step: the order of admission is the
    priorities'. Under first come, first served a priority is refused."""
    llm = fake_llm(FakeRunnerFactory(), max_num_batched_tokens=8, scheduling_policy="priority")
    try:
        prompts = [[7] * 8, [8] * 8, [9] * 8]
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
        assert [o.outputs[0].token_ids for o in outputs] == [
            reference_output(p, 2) for p in prompts
        ]
        runner = llm.engine.gpu.call(lambda: llm.engine.gpu.runner.fake).result()
        index = {o.request_id: i for i, o in enumerate(outputs)}
        first_seen = [
            c.request_id for plan in runner.plans for c in plan.chunks if c.start_pos == 0
        ]
        assert [index[rid] for rid in first_seen] == [1, 2, 0]
        with pytest.raises(ValueError, match="one entry per prompt"):
            llm.generate(prompts, params, use_tqdm=False, priority=[1])
        # Priorities that cannot be ordered with ints are refused by name, leaving nothing
        # queued (a None once reached the queue's comparison, and stayed in the scheduler).
        for bad in ([None, 1], [1.5, 0], ["b", "a"], [True, 0]):
            with pytest.raises(ValueError, match="priority must be an integer"):
                llm.generate(prompts[:2], params, use_tqdm=False, priority=bad)
            assert not llm.engine.scheduler.requests
    finally:
        llm.shutdown()
    fifo = fake_llm(FakeRunnerFactory())
    try:
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            fifo.generate([[7] * 4], SamplingParams(max_tokens=1), use_tqdm=False, priority=[3])
    finally:
        fifo.shutdown()


async def test_http_priority_needs_the_priority_policy(aiohttp_client):
    for policy, status in (("fcfs", 400), ("priority", 200)):
        engine = await build_engine(scheduling_policy=policy)
        try:
            client = await aiohttp_client(create_app(engine, ServerConfig()))
            body = {"prompt": "Hi", "max_tokens": 2, "priority": -5}
            response, raw = await post(client, "/v1/completions", body)
            assert response.status == status, raw
            if status == 400:
                assert error_of(raw, 400)["param"] == "priority"
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 1}
            response, raw = await post(client, "/v1/chat/completions", chat)
            assert response.status == status, raw
        finally:
            await engine.shutdown()


async def test_the_queue_timeout_sees_old_requests_behind_young_high_priority_ones():
    engine = await build_engine(
        step_delay=0.05, max_num_seqs=1, queue_timeout=5.0, scheduling_policy="priority"
    )
    try:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        engine.add_request([5, 6, 7], params, "running")
        await asyncio.sleep(0.2)  # it holds the only seat from now on
        engine.add_request([5, 6], params, "old", priority=5)
        engine.add_request([5, 6], params, "young", priority=0)
        requests = engine.scheduler.requests
        assert [r.request_id for r in engine.scheduler.waiting] == ["young", "old"]
        now = requests["old"].arrival_time + 6.0
        requests["young"].arrival_time = now - 1.0
        assert engine.expire_queued(now) == 1
        assert "old" not in requests and "young" in requests
    finally:
        await engine.shutdown()
