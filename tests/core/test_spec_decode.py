"""Speculative decoding by prompt lookup: the proposer, the verification rule, the config, and
the scheduler's bookkeeping of drafts (K/V positions, blocks, prefix cache, stops)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioinfer.config import NgramSpeculation, SchedulerConfig
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.request import Request
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.scheduler import Scheduler
from aioinfer.core.spec_decode import NgramProposer, draft_rows, verify
from aioinfer.core.step import ScheduledChunk
from tests.core.test_scheduler import run_to_completion
from tests.support.fake_runner import FakeRunner, reference_output, repeating_next_token


def naive_lookup(tokens: list[int], k: int, low: int, high: int) -> tuple[int, ...]:
    """The proposer's rule, written as plainly as possible."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


# Values whose 4-byte forms share bytes, so a byte search could match across token boundaries.
TOKENS = st.sampled_from([0, 1, 2, 256, 257, 65536, 16777216, 16777217])


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(TOKENS, min_size=1, max_size=40),
    k=st.integers(1, 6),
    low=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_proposer_matches_the_plain_rule(tokens, k, low, extra):
    proposer = NgramProposer(NgramSpeculation(k, low, low + extra))
    # Grown one token at a time, as a request's context is.
    for end in range(1, len(tokens) + 1):
        got = proposer.propose("r", tokens[:end], max_drafts=k)
        assert got == naive_lookup(tokens[:end], k, low, low + extra)


def test_proposer_takes_the_longest_then_the_latest_match_and_caps_the_count():
    proposer = NgramProposer(NgramSpeculation(3, 1, 3))
    # "1 2" occurs twice before the end; "7 1 2" only once, so the longer match wins.
    tokens = [7, 1, 2, 9, 9, 9, 1, 2, 8, 8, 7, 1, 2]
    assert proposer.propose("a", tokens, max_drafts=3) == (9, 9, 9)
    assert proposer.propose("b", tokens, max_drafts=1) == (9,)
    assert proposer.propose("c", tokens, max_drafts=0) == ()
    # Without the longer match the latest "1 2" is used.
    assert proposer.propose("d", [1, 2, 5, 1, 2, 6, 1, 2], max_drafts=3) == (6, 1, 2)
    assert proposer.propose("e", [1, 2, 3, 4], max_drafts=3) == ()


def test_verify_keeps_matching_drafts_and_the_token_after_them():
    assert verify((), [5]) == [5]
    assert verify((4, 5, 6), [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert verify((4, 5, 6), [4, 9, 6, 7]) == [4, 9]
    assert verify((4, 5, 6), [3, 5, 6, 7]) == [3]
    with pytest.raises(ValueError, match="3 drafts need 4"):
        verify((4, 5, 6), [4, 5, 6])


def test_draft_rows_move_the_output_index_and_the_drafts_before_them_on():
    chunk = ScheduledChunk(
        request_id="r",
        token_ids=(8, 4, 5),
        start_pos=10,
        block_table=(1, 2, 3),
        sample=True,
        sampling_params=SamplingParams(presence_penalty=0.5),
        output_index=3,
        history=(1, 2, 8),
        draft_token_ids=(4, 5),
    )
    rows = draft_rows(chunk)
    assert [r.output_index for r in rows] == [3, 4, 5]
    # Each row follows the shared history and the drafts before its position.
    assert all(r.history is chunk.history for r in rows)
    assert [r.draft_token_ids for r in rows] == [(), (4,), (4, 5)]
    plain = ScheduledChunk("p", (8,), 10, (1,), True, SamplingParams())
    assert draft_rows(plain) == [plain]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method must be 'ngram'"),
        ('{"method": "ngram"}', "num_speculative_tokens must be in"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in"),
        ('{"method": "ngram", "num_speculative_tokens": 2.5}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "got 'model'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ("[1]", "must be a JSON object"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0, '
            '"prompt_lookup_max": 3}',
            "need 1 <= prompt_lookup_min",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
            '"prompt_lookup_max": 0}',
            "prompt_lookup_min <= prompt_lookup_max, got 2 and 0",
        ),
    ],
)
def test_bad_speculative_configs_name_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(speculative_config=value)


def test_speculative_config_defaults_follow_vllm():
    def parse(**spec):
        return SchedulerConfig(speculative_config={"method": "ngram", **spec}).speculation

    assert parse(num_speculative_tokens=3) == NgramSpeculation(3, 5, 5)
    assert parse(num_speculative_tokens=3, prompt_lookup_max=4) == NgramSpeculation(3, 4, 4)
    assert parse(num_speculative_tokens=3, prompt_lookup_min=2) == NgramSpeculation(3, 2, 2)
    assert SchedulerConfig().speculation is None


# ----------------------------------------------------------------------------- scheduler


def spec_engine(*, num_blocks=64, budget=32, k=4, disable_by_batch_size=None, prefix=True):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix)
    spec = NgramSpeculation(k, 1, 3, disable_by_batch_size)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, speculation=spec)
    return sched, FakeRunner(num_blocks, 4, next_token=repeating_next_token)


def add(sched, rid, prompt, max_tokens, **params):
    sched.add(
        Request(
            rid,
            prompt,
            SamplingParams(**params),
            max_tokens=max_tokens,
            eos_token_ids=frozenset({1}),
        )
    )


def test_drafts_give_the_reference_output_in_fewer_steps():
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    expected = reference_output(prompt, 40, next_token=repeating_next_token)
    sched, runner = spec_engine()
    add(sched, "r", prompt, 40, ignore_eos=True)
    outputs, finished = run_to_completion(sched, runner)
    assert outputs["r"] == expected
    assert finished["r"] == "length"
    stats = sched.spec_stats
    assert stats.num_accepted_tokens > 20
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some were rejected, too
    assert len(runner.plans) < 40 - stats.num_accepted_tokens + 3
    assert sched.kv.pool.num_free_blocks == 63


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.sampled_from([14, 24, 64]))
def test_random_workloads_with_drafts_finish_exactly_and_leave_no_block(seed, num_blocks):
    """Preemption, prefix hits, stop tokens and max_tokens with drafts in flight: every output
    equals the one-token-at-a-time reference, and every block comes back."""
    rng = random.Random(seed)
    sched, runner = spec_engine(num_blocks=num_blocks, budget=rng.choice([6, 16, 32]))
    pattern = [rng.randrange(2, 12) for _ in range(rng.randint(2, 6))]
    expected = {}
    for i in range(6):
        prompt = [*(pattern * 6)[: rng.randint(1, 20)], rng.randrange(2, 50)]
        max_tokens = rng.randint(1, 25)
        stop = rng.choice([(), (rng.randrange(2, 50),)])
        add(sched, f"r{i}", prompt, max_tokens, ignore_eos=True, stop_token_ids=list(stop))
        expected[f"r{i}"] = reference_output(prompt, max_tokens, stop, repeating_next_token)
    outputs, _ = run_to_completion(sched, runner)
    assert outputs == expected
    assert sched.kv.pool.num_free_blocks == num_blocks - 1
    assert sched.proposer is not None and not sched.proposer._tokens


def test_no_drafts_beyond_max_tokens_the_budget_or_min_tokens():
    prompt = [5, 6, 7] * 4
    sched, runner = spec_engine(budget=4)
    add(sched, "r", prompt, 3, ignore_eos=True)
    add(sched, "m", prompt, 10, ignore_eos=True, min_tokens=4)
    drafted: dict[str, list[tuple[int, int]]] = {"r": [], "m": []}
    while sched.has_work():
        plan = sched.schedule()
        assert plan.num_tokens <= 4
        for chunk in plan.chunks:
            drafted[chunk.request_id].append((chunk.output_index, len(chunk.draft_token_ids)))
        sched.apply(plan, runner.execute(plan))
    # A draft past max_tokens could never be emitted.
    assert all(n <= 3 - index - 1 for index, n in drafted["r"])
    assert any(n for _, n in drafted["r"])
    # min_tokens 4: no drafts before the fourth output token (the bans move with each token).
    assert all(n == 0 for index, n in drafted["m"] if index < 4)
    assert any(n for _, n in drafted["m"])


def test_disable_by_batch_size_turns_drafts_off_for_busy_steps():
    prompt = [5, 6, 7] * 4
    sched, runner = spec_engine(disable_by_batch_size=2)
    add(sched, "a", prompt, 12, ignore_eos=True)
    add(sched, "b", prompt, 12, ignore_eos=True)
    run_to_completion(sched, runner)
    assert sched.spec_stats.num_drafts == 0
    sched, runner = spec_engine(disable_by_batch_size=2)
    add(sched, "a", prompt, 12, ignore_eos=True)
    run_to_completion(sched, runner)
    assert sched.spec_stats.num_drafts > 0


def test_rejected_drafts_never_reach_the_prefix_cache():
    """A second request with the same prompt and output as the first must hit only blocks of
    real tokens: a block cached with a rejected draft's K/V would change its output."""
    prompt = [5, 6, 7, 8] * 3
    expected = reference_output(prompt, 30, next_token=repeating_next_token)
    sched, runner = spec_engine()
    add(sched, "first", prompt, 30, ignore_eos=True)
    run_to_completion(sched, runner)
    add(sched, "second", prompt + expected, 8, ignore_eos=True)
    outputs, _ = run_to_completion(sched, runner)
    assert outputs["second"] == reference_output(
        prompt + expected, 8, next_token=repeating_next_token
    )
    assert sched.kv.stats.hits > len(prompt)
