from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioinfer.config import NgramSpeculation
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.request import Request, RequestStatus
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.scheduler import Scheduler
from tests.support.fake_runner import FakeRunner, reference_output, repeating_next_token


def make_engine(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return sched, FakeRunner(num_blocks, block_size)


def make_request(rid, prompt, max_tokens=8, **params):
    return Request(
        rid, prompt, SamplingParams(**params), max_tokens=max_tokens, eos_token_ids=frozenset({1})
    )


def run_to_completion(
    sched: Scheduler, runner: FakeRunner, max_steps=10_000, on_step=None, ahead=False
):
    """Plan, run and apply until no work is left. With `ahead`, as the engine's step loop
    overlaps steps: the next plan is built and run before the last one's result is applied,
    wherever the scheduler allows it."""
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    steps = 0

    def plan_and_run():
        plan = sched.schedule()
        assert plan.num_tokens <= sched.max_num_batched_tokens
        assert len(plan.chunks) <= sched.max_num_seqs
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        return plan, runner.execute(plan)

    in_flight = None
    while sched.has_work() or in_flight is not None:
        if in_flight is None:
            in_flight = plan_and_run()
        following = None
        if ahead and sched.has_work() and sched.can_plan_ahead(in_flight[0]):
            following = plan_and_run()
        for update in sched.apply(*in_flight):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                finished[update.request_id] = update.request.finish_reason
        sched.kv.check_integrity()
        if on_step:
            on_step(steps)
        steps += 1
        assert steps < max_steps, "no progress"
        in_flight = following
    return outputs, finished


def test_batch_outputs_equal_unbatched_reference():
    sched, runner = make_engine()
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(2, 50) for _ in range(rng.randint(1, 30))] for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add(make_request(rid, prompt, max_tokens=10, ignore_eos=True))
    outputs, finished = run_to_completion(sched, runner)
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(prompt, 10)
        assert finished[rid] == "length"
    assert sched.kv.pool.num_free_blocks == 63


def test_chunked_prefill_splits_a_long_prompt_over_the_budget():
    sched, runner = make_engine(budget=8)
    sched.add(make_request("long", list(range(2, 22)), max_tokens=2, ignore_eos=True))  # 20 tokens
    plans = []
    while sched.has_work():
        plan = sched.schedule()
        plans.append([(c.start_pos, c.num_tokens, c.sample) for c in plan.chunks])
        sched.apply(plan, runner.execute(plan))
    assert plans == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)]]


def test_running_requests_decode_before_waiting_prompts_are_admitted():
    sched, runner = make_engine(budget=10)
    sched.add(make_request("a", [5] * 4, max_tokens=5, ignore_eos=True))
    plan = sched.schedule()
    sched.apply(plan, runner.execute(plan))
    sched.add(make_request("b", [6] * 30, max_tokens=5, ignore_eos=True))
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 9)]


def test_max_num_seqs_caps_the_batch():
    sched, _ = make_engine(max_num_seqs=2, budget=100)
    for i in range(5):
        sched.add(make_request(f"r{i}", [i + 2] * 3, ignore_eos=True))
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert sched.num_waiting == 3


def test_prefix_cache_hit_skips_computed_tokens_and_keeps_outputs():
    sched, runner = make_engine(block_size=4, budget=64)
    prompt = list(range(2, 20))  # 18 tokens: 4 full blocks
    sched.add(make_request("a", prompt, max_tokens=3, ignore_eos=True))
    out_a, _ = run_to_completion(sched, runner)
    sched.add(make_request("b", prompt, max_tokens=3, ignore_eos=True))
    plan = sched.schedule()
    [chunk] = plan.chunks
    assert chunk.start_pos == 16 and chunk.num_tokens == 2
    out_b = {"b": [u.new_token_ids[0] for u in sched.apply(plan, runner.execute(plan))]}
    rest, _ = run_to_completion(sched, runner)
    out_b["b"] += rest["b"]
    assert out_a["a"] == out_b["b"] == reference_output(prompt, 3)
    assert sched.kv.stats.hits == 16 and sched.kv.stats.queries == 36


def test_preemption_when_blocks_run_out_still_gives_exact_outputs():
    # 9 usable blocks of 4 tokens; 4 requests growing to 24 tokens each cannot all fit.
    sched, runner = make_engine(num_blocks=10, block_size=4, budget=64)
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(2, 50) for _ in range(8)] for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add(make_request(rid, prompt, max_tokens=16, ignore_eos=True))
    outputs, finished = run_to_completion(sched, runner)
    assert sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(prompt, 16)
        assert finished[rid] == "length"
    assert sched.kv.pool.num_free_blocks == 9


def test_newest_running_request_is_preempted_first():
    sched, runner = make_engine(num_blocks=5, block_size=2, budget=64)  # 4 usable blocks
    sched.add(make_request("old", [2, 3, 4], max_tokens=8, ignore_eos=True))
    sched.add(make_request("new", [5, 6, 7], max_tokens=8, ignore_eos=True))
    # Step 1 fills all 4 blocks; step 2 fits in them; step 3 needs a fifth.
    for _ in range(3):
        plan = sched.schedule()
        sched.apply(plan, runner.execute(plan))
    assert [r.request_id for r in sched.running] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["new"]
    assert sched.requests["new"].num_computed_tokens == 0


def test_prompt_logprobs_are_not_computed_again_once_the_first_token_is_out():
    """They go out with the first token: a request preempted before it recomputes them, one
    preempted after it does not."""
    sched, runner = make_engine(num_blocks=7, block_size=2, budget=64)  # 6 usable blocks
    sched.add(make_request("old", [2, 3, 4], max_tokens=8, ignore_eos=True))
    sched.add(make_request("new", [5, 6, 7], max_tokens=6, ignore_eos=True, prompt_logprobs=1))
    outputs, _ = run_to_completion(sched, runner)  # "new" is preempted after its first token
    assert outputs["new"] == reference_output([5, 6, 7], 6)
    restarts = [
        (c.start_pos, c.prompt_logprob_targets)
        for p in runner.plans
        for c in p.chunks
        if c.request_id == "new" and c.start_pos == 0
    ]
    assert restarts == [(0, (6, 7)), (0, None)]


def test_eos_stop_token_ids_and_min_tokens():
    sched, runner = make_engine()
    prompt = [7, 8, 9]
    ref = reference_output(prompt, 20)
    stop_at = ref[2]
    sched.add(make_request("stop", prompt, max_tokens=20, stop_token_ids=[stop_at]))
    outputs, finished = run_to_completion(sched, runner)
    assert outputs["stop"] == ref[: ref.index(stop_at) + 1]
    assert finished["stop"] == "stop"
    # min_tokens bans the stop token until enough tokens exist.
    sched.add(make_request("min", prompt, max_tokens=20, stop_token_ids=[stop_at], min_tokens=5))
    outputs, _ = run_to_completion(sched, runner)
    assert len(outputs["min"]) >= 5
    assert stop_at not in outputs["min"][:4]


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "in_flight"])
def test_abort_in_any_state_frees_every_block(when):
    sched, runner = make_engine(budget=8)
    sched.add(make_request("x", list(range(2, 22)), max_tokens=50, ignore_eos=True))
    sched.add(make_request("y", [3, 4, 5], max_tokens=50, ignore_eos=True))
    steps = {"waiting": 0, "prefilling": 1, "decoding": 4}.get(when, 2)
    for _ in range(steps):
        plan = sched.schedule()
        sched.apply(plan, runner.execute(plan))
    if when == "in_flight":
        plan = sched.schedule()
        assert sched.abort("x").status == RequestStatus.FINISHED_ABORTED
        sched.apply(plan, runner.execute(plan))
    else:
        assert sched.abort("x") is not None
    assert sched.abort("x") is None  # idempotent
    assert "x" not in sched.kv.block_tables
    sched.kv.check_integrity()
    sched.abort("y")
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert "x" in sched.schedule().finished_request_ids


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(1, 6),
    ahead=st.booleans(),
)
def test_random_workloads_finish_exactly_and_leave_no_block(
    seed, num_blocks, block_size, budget, max_num_seqs, ahead
):
    rng = random.Random(seed)
    sched, runner = make_engine(num_blocks, block_size, max_num_seqs, budget)
    capacity = (num_blocks - 1) * block_size
    prompts, abort_at = {}, {}
    for i in range(rng.randint(1, 8)):
        # Every request must fit the pool alone, as the engine's max model len guarantees.
        prompt_len = rng.randint(1, max(1, min(20, capacity - 8)))
        prompts[f"r{i}"] = [rng.randrange(2, 5) for _ in range(prompt_len)]  # shared prefixes
        max_tokens = min(8, capacity - prompt_len)
        sched.add(make_request(f"r{i}", prompts[f"r{i}"], max_tokens=max_tokens, ignore_eos=True))
        if rng.random() < 0.2:
            abort_at[f"r{i}"] = rng.randint(0, 6)

    def maybe_abort(step):
        for rid, at in abort_at.items():
            if at == step:
                sched.abort(rid)

    outputs, finished = run_to_completion(sched, runner, on_step=maybe_abort, ahead=ahead)
    for rid, prompt in prompts.items():
        if finished.get(rid) == "length":
            max_tokens = min(8, capacity - len(prompt))
            assert outputs[rid] == reference_output(prompt, max_tokens)
        else:
            assert rid in abort_at
    assert sched.kv.pool.num_free_blocks == num_blocks - 1
    assert not sched.requests


class RopeModeRunner(FakeRunner):
    """Also records the factors each slot's K/V were computed with, and checks that every
    chunk reads K/V of its own kind only and that a chunk with the short factors stays within
    the original context."""

    def __init__(self, num_blocks, block_size, original, **kwargs):
        super().__init__(num_blocks, block_size, **kwargs)
        self.original = original
        self.long_slots: list[bool | None] = [None] * (num_blocks * block_size)

    def execute(self, plan):
        for chunk in plan.chunks:
            end = chunk.start_pos + chunk.num_tokens
            assert chunk.long_rope or end <= self.original, chunk
            for slot in chunk.slot_mapping(self.block_size):
                self.long_slots[slot] = chunk.long_rope
            for p in range(chunk.start_pos):  # the context before the chunk: cached or earlier
                block = chunk.block_table[p // self.block_size]
                assert self.long_slots[block * self.block_size + p % self.block_size] is (
                    chunk.long_rope
                ), f"{chunk.request_id} reads K/V of the other factors at {p}"
        return super().execute(plan)


@pytest.mark.parametrize("speculate", [False, True])
def test_longrope_requests_past_the_original_context_are_computed_with_the_long_factors(
    speculate,
):
    """A request longer than the original context takes the long factors from its first token;
    one that grows past it is computed again from its first token, once; prefix-cache hits
    never cross between the two kinds of K/V."""
    original, block_size = 12, 4
    kv = KVCacheManager(64, block_size)
    spec = NgramSpeculation(3, 1, 3) if speculate else None
    sched = Scheduler(
        kv, max_num_seqs=8, max_num_batched_tokens=8, speculation=spec, longrope_original=original
    )
    runner = RopeModeRunner(64, block_size, original, next_token=repeating_next_token)
    shared = [5, 6, 7, 8, 9, 5, 6, 7]  # two full blocks
    prompts = {
        "short": shared[:3],  # 3 + 6 tokens: within the original context
        "grows": [*shared, 3],  # 9 + 10 tokens: past it while decoding
        "long": [*shared, 4, 5, 6, 7, 8, 9],  # 14 tokens: past it from the start
        "long2": [*shared, 4, 5, 6, 7, 8, 9, 2],  # hits "long"'s cached blocks
    }
    max_tokens = {"short": 6, "grows": 10, "long": 4, "long2": 4}
    for rid, prompt in prompts.items():
        request = make_request(rid, prompt, max_tokens=max_tokens[rid], ignore_eos=True)
        sched.add(request)
        if rid == "long":
            outputs, _ = run_to_completion(sched, runner)  # "long2" comes after it finished
    later, _ = run_to_completion(sched, runner)
    outputs.update(later)
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(
            prompt, max_tokens[rid], next_token=repeating_next_token
        )
    restarts = {
        rid: [c.long_rope for p in runner.plans for c in p.chunks if c.request_id == rid and
              c.start_pos == 0]
        for rid in prompts
    }  # fmt: skip
    assert restarts == {"short": [False], "grows": [False, True], "long": [True], "long2": []}
    assert kv.stats.hits > 0  # "long2" started from "long"'s blocks
    assert kv.pool.num_free_blocks == 63 and not sched.requests


def test_a_stop_string_found_only_in_the_last_text_makes_the_finish_a_stop():
    """The stop string's last character comes in one token with the lead byte of a character
    the output then ends in the middle of (length): the text is cut at the stop string only
    when flushed, and the finish agrees with it (stop, the string)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from aioinfer.core.detokenizer import IncrementalDetokenizer
    from tests.support.tokenizers import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> the character a byte-level vocabulary writes it as
    vocab = {chars[b]: b for b in range(256)}
    vocab["b" + chars[0xE4]] = 256  # "b" and the lead byte of a three-byte character
    model = models.BPE(vocab, [("b", chars[0xE4])])
    backend = Tokenizer(model)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokens = [ord("a"), 256]
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32)
    runner = FakeRunner(64, 4, next_token=lambda context: tokens[len(context) - 3])
    request = Request("r", [5, 6, 7], SamplingParams(stop=["b"]), max_tokens=2)
    request.detokenizer = IncrementalDetokenizer(tokenizer, [5, 6, 7], stop=["b"])
    sched.add(request)
    text = ""
    while sched.has_work():
        plan = sched.schedule()
        for update in sched.apply(plan, runner.execute(plan)):
            text += update.text_delta
    assert text == "a"
    assert (request.finish_reason, request.stop_reason) == ("stop", "b")


def test_min_tokens_holds_off_stop_strings_through_its_last_token():
    """As vLLM: the first min_tokens tokens cannot end the output by a stop string either."""
    from aioinfer.core.detokenizer import IncrementalDetokenizer
    from tests.support.tokenizers import byte_token_ids, make_tokenizer

    tokenizer = make_tokenizer()
    ids = byte_token_ids(tokenizer)
    tokens = [ids[ord("x")], ids[ord("y")], ids[ord("x")], ids[ord("z")]]
    results = {}
    for min_tokens in (0, 1):
        sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=32)
        runner = FakeRunner(64, 4, next_token=lambda context: tokens[len(context) - 3])
        params = SamplingParams(stop=["x"], min_tokens=min_tokens)
        request = Request("r", [5, 6, 7], params, max_tokens=4)
        request.detokenizer = IncrementalDetokenizer(tokenizer, [5, 6, 7], stop=["x"])
        sched.add(request)
        text = ""
        while sched.has_work():
            plan = sched.schedule()
            text += "".join(u.text_delta for u in sched.apply(plan, runner.execute(plan)))
        results[min_tokens] = (text, request.num_output_tokens)
    assert results == {0: ("", 1), 1: ("xy", 3)}


# ----------------------------------------------------------------------------- planned ahead


def test_a_step_planned_ahead_feeds_the_token_in_flight_and_keeps_every_output():
    """Each decode is planned while the step before runs: it feeds a stand-in for the token
    that step samples, which the runner puts in; outputs are those of one step at a time."""
    prompts = {f"r{i}": [5 + i, 9, 2 + i] * (1 + i) for i in range(5)}
    results = []
    for ahead in (False, True):
        sched, runner = make_engine(budget=16)
        for rid, prompt in prompts.items():
            sched.add(make_request(rid, prompt, max_tokens=9, ignore_eos=True))
        results.append(run_to_completion(sched, runner, ahead=ahead))
        assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
        fed = [c for p in runner.plans for c in p.chunks if c.previous_token]
        assert bool(fed) == ahead
        assert all(c.num_tokens == 1 and c.token_ids == (0,) for c in fed)
    assert results[0] == results[1]
    for rid, prompt in prompts.items():
        assert results[1][0][rid] == reference_output(prompt, 9)


def test_a_stop_in_flight_cuts_the_output_where_it_stops():
    """A request that the step in flight ends (its EOS, a stop id) runs once more in the step
    planned ahead; what that step samples for it is dropped, and its blocks are freed once."""
    prompt = [4, 7, 9]
    stops = reference_output(prompt, 20)
    stop_id = stops[5]
    sched, runner = make_engine(budget=16)
    sched.add(make_request("s", prompt, max_tokens=20, stop_token_ids=[stop_id]))
    sched.add(make_request("m", [6, 6], max_tokens=4, ignore_eos=True, min_tokens=3))
    outputs, finished = run_to_completion(sched, runner, ahead=True)
    assert outputs["s"] == stops[: stops.index(stop_id) + 1] and finished["s"] == "stop"
    assert outputs["m"] == reference_output([6, 6], 4) and finished["m"] == "length"
    ran = [c.request_id for p in runner.plans for c in p.chunks]
    assert ran.count("m") == 4  # max_tokens known ahead: no step past its last token
    assert ran.count("s") == stops.index(stop_id) + 2  # one step past its stop, dropped
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_min_tokens_bans_count_the_token_in_flight():
    """Stop ids are banned until min_tokens are out; planned ahead, the token in flight counts
    (the runner's stand-in model then picks another token instead)."""
    outputs = []
    for ahead in (False, True):
        sched, runner = make_engine()
        prompt = [8, 3]
        first = reference_output(prompt, 6)
        sched.add(make_request("r", prompt, max_tokens=6, min_tokens=3, stop_token_ids=first))
        outputs.append(run_to_completion(sched, runner, ahead=ahead))
    assert outputs[0] == outputs[1]
    assert not set(outputs[1][0]["r"][:3]) & set(first)  # banned while min_tokens held


def test_requests_that_need_their_last_token_on_the_host_are_not_planned_ahead():
    sched, runner = make_engine()
    sched.add(make_request("a", [5, 6], max_tokens=4, ignore_eos=True))
    plan = sched.schedule()
    assert sched.can_plan_ahead(plan)
    sched.apply(plan, runner.execute(plan))
    sched.add(make_request("p", [5, 7], max_tokens=4, ignore_eos=True, repetition_penalty=1.2))
    plan = sched.schedule()
    assert not sched.can_plan_ahead(plan)  # p's next step needs its history
    sched.apply(plan, runner.execute(plan))
    run_to_completion(sched, runner, ahead=True)
    fed = [c.request_id for p in runner.plans for c in p.chunks if c.previous_token]
    assert "p" not in fed


def test_preemption_while_a_step_is_in_flight_keeps_outputs_exact():
    sched, runner = make_engine(num_blocks=9, block_size=2, budget=8, max_num_seqs=4)
    prompts = {f"r{i}": [3 + i] * 3 for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add(make_request(rid, prompt, max_tokens=6, ignore_eos=True))
    outputs, finished = run_to_completion(sched, runner, ahead=True)
    assert sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(prompt, 6) and finished[rid] == "length"
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
