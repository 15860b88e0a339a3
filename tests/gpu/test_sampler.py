"""The sampler against independent references: plain-Python truncation and penalties, Hugging
Face's repetition penalty, torch.log_softmax, and softmax(logits / T) sampled many times."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from aioinfer.core.constraints import TokenConstraints, mask_allows, token_mask
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import ScheduledChunk
from aioinfer.gpu.sampler import (
    Sampler,
    compute_prompt_logprobs,
    exponential_,
    process_logits,
    seeded_generator_seed,
    truncate_logits,
)
from aioinfer.gpu.token_masks import mask_bias
from aioinfer.model.cpu import kernels as cpu_native

CPU = torch.device("cpu")
FAST = settings(max_examples=25, deadline=None)


def chunk(
    request_id: str,
    params: SamplingParams,
    *,
    history: Sequence[int] | None = None,
    prompt_len: int = 0,
    banned: Sequence[int] = (),
    output_index: int = 0,
    sample: bool = True,
    allowed: Sequence[int] | None = None,
    vocab: int = 0,
) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request_id,
        token_ids=(1,),
        start_pos=3,
        block_table=(0,),
        sample=sample,
        sampling_params=params,
        output_index=output_index,
        history=None if history is None else tuple(history),
        prompt_len=prompt_len,
        banned_token_ids=tuple(banned),
        constraints=None
        if allowed is None
        else TokenConstraints(allowed=token_mask(allowed, vocab)),
    )


def sample_ids(sampler: Sampler, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[int]:
    out = sampler.sample(logits, sampler.prepare(chunks))
    sampled, _ = out.to_host(chunks)
    return [sampled[c.request_id] for c in chunks if c.sample]


def repeat_rows(row: torch.Tensor, params: SamplingParams, n: int) -> tuple:
    chunks = [chunk(f"r{i}", params) for i in range(n)]
    return row.unsqueeze(0).expand(n, -1).contiguous(), chunks


# ---- references ---------------------------------------------------------------------------------


def softmax64(values: Sequence[float]) -> list[float]:
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def reference_allowed(
    logits: Sequence[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Tokens that temperature, min_p, top_k then top_p leave, ties at each boundary kept."""
    z = [v / temperature for v in logits]
    probs = softmax64(z)
    pmax = max(probs)
    keep = {i for i, p in enumerate(probs) if p >= min_p * pmax}
    if top_k > 0:
        values = sorted((z[i] for i in keep), reverse=True)
        kth = values[min(top_k, len(values)) - 1]
        keep = {i for i in keep if z[i] >= kth}
    if top_p < 1.0:
        kept = softmax64([z[i] if i in keep else -math.inf for i in range(len(z))])
        order = sorted(keep, key=lambda i: -kept[i])
        mass, threshold = 0.0, kept[order[0]]
        for i in order:
            if mass >= top_p:
                break
            threshold = kept[i]
            mass += kept[i]
        keep = {i for i in keep if kept[i] >= threshold}
    return keep


def boundary_margin(
    logits: Sequence[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> float:
    """How far the float64 reference is from a min_p or top_p boundary (float32 may disagree)."""
    z = [v / temperature for v in logits]
    probs = softmax64(z)
    pmax = max(probs)
    margins = [abs(p / pmax - min_p) for p in probs if min_p > 0]
    if top_p < 1.0:
        keep = reference_allowed(logits, temperature, top_k, 1.0, min_p)
        kept = softmax64([z[i] if i in keep else -math.inf for i in range(len(z))])
        mass = 0.0
        for i in sorted(keep, key=lambda i: -kept[i]):
            margins.append(abs(mass - top_p))
            mass += kept[i]
    return min(margins, default=1.0)


def reference_penalties(
    logits: Sequence[float],
    history: Sequence[int],
    prompt_len: int,
    params: SamplingParams,
    banned: Sequence[int],
) -> list[float]:
    out = [float(v) for v in logits]
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    for token in banned:
        out[token] = -math.inf
    for token in set(history):
        v = out[token]
        out[token] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
    counts = Counter(history[prompt_len:])
    for token, count in counts.items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


# ---- greedy -------------------------------------------------------------------------------------


@FAST
@given(st.integers(1, 6), st.integers(2, 40), st.integers(0, 2**31), st.booleans())
def test_greedy_is_argmax(batch: int, vocab: int, seed: int, ties: bool) -> None:
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))
    if ties:  # the first of equal maxima wins, as with argmax
        logits = logits.round()
    chunks = [chunk(f"r{i}", SamplingParams(temperature=0.0)) for i in range(batch)]
    sampler = Sampler(vocab, CPU, seed=0)
    before = logits.clone()
    assert sample_ids(sampler, logits, chunks) == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)


def test_greedy_rows_of_mixed_batch_take_argmax_of_processed_logits() -> None:
    vocab = 32
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    top = int(logits[2].argmax())
    chunks = [
        chunk("g0", SamplingParams(temperature=0.0)),
        chunk("s1", SamplingParams(temperature=1.0, top_k=3)),
        chunk("g2", SamplingParams(temperature=0.0), banned=[top]),
        chunk("g3", SamplingParams(temperature=0.0, logit_bias={5: 100.0})),
    ]
    before = logits.clone()
    ids = sample_ids(Sampler(vocab, CPU, seed=0), logits, chunks)
    second = int(logits[2].topk(2).indices[1])
    assert [ids[0], ids[2], ids[3]] == [int(logits[0].argmax()), second, 5]
    assert ids[1] in logits[1].topk(3).indices.tolist()
    assert torch.equal(logits, before)


# ---- seeded sampling ----------------------------------------------------------------------------


@pytest.mark.parametrize("ops", ["torch", "native"])
def test_seeded_sampling_reproduces_whatever_the_batch(ops: str) -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(vocab, generator=gen) * 0.5
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    sampler = Sampler(vocab, CPU, cpu_kernels=sampler_kernels(ops))

    def run(step: int, others: int, position: int) -> int:
        rows = [torch.randn(vocab, generator=gen) for _ in range(others)]
        chunks = [
            chunk(f"o{i}", SamplingParams(temperature=[0.0, 1.0, 0.5][i % 3], seed=i or None))
            for i in range(others)
        ]
        rows.insert(position, target)
        chunks.insert(position, chunk("x", params, output_index=step))
        ids = sample_ids(sampler, torch.stack(rows), chunks)
        return ids[position]

    alone = [run(step, 0, 0) for step in range(12)]
    assert len(set(alone)) > 1  # the noise moves on with output_index
    for others, position in [(1, 1), (3, 0), (5, 3), (7, 7)]:
        assert [run(step, others, position) for step in range(12)] == alone
    # Another sampler (another unseeded generator) draws the same seeded tokens.
    assert [run(step, 2, 1) for step in range(12)] == alone


def test_seeded_generator_seed_is_a_64_bit_mix() -> None:
    seeds = {seeded_generator_seed(s, i) for s in (-1, 0, 1, 2**64 - 1) for i in range(50)}
    assert len(seeds) == 150  # -1 and 2**64 - 1 are the same seed modulo 2**64
    assert all(0 <= s < 2**64 for s in seeds)


# ---- truncation ---------------------------------------------------------------------------------

truncation_cases = st.tuples(
    st.lists(st.sampled_from([-3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0]), min_size=2, max_size=20)
    # Multiples of 1/64 are exact in float32 and never merge into ties after a division by T.
    | st.lists(st.integers(-256, 256).map(lambda x: x / 64), min_size=2, max_size=20),
    st.floats(0.3, 2.0),
    st.integers(0, 25),
    st.floats(0.05, 1.0) | st.just(1.0),
    st.floats(0.0, 1.0) | st.just(0.0),
)


def sampler_kernels(ops: str) -> cpu_native.NativeKernels | None:
    """What the sampler's noise and top_p thresholds run on: torch ops, or the native kernels."""
    if ops == "torch":
        return None
    kernels = cpu_native.load()
    if kernels is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    return kernels


@pytest.mark.parametrize("ops", ["torch", "native"])
@settings(max_examples=60, deadline=None)
@given(truncation_cases)
def test_truncation_keeps_exactly_the_reference_set(ops: str, case: tuple) -> None:
    values, temperature, top_k, top_p, min_p = case
    assume(boundary_margin(values, temperature, top_k, top_p, min_p) > 1e-4)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    chunks = [chunk("a", params), chunk("b", SamplingParams(temperature=1.0))]
    logits = torch.tensor([values, values], dtype=torch.float32)
    sampler = Sampler(len(values), CPU, seed=0)
    kernels = sampler_kernels(ops)
    search = kernels.top_p_thresholds if kernels else None  # else a sort of each row
    out = truncate_logits(logits.clone(), sampler.prepare(chunks), search)
    kept = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    assert kept == reference_allowed(values, temperature, top_k, top_p, min_p)
    assert torch.isfinite(out[1]).all()  # the other row is untouched


@FAST
@given(truncation_cases)
def test_truncation_never_samples_outside_the_allowed_set(case: tuple) -> None:
    values, temperature, top_k, top_p, min_p = case
    assume(boundary_margin(values, temperature, top_k, top_p, min_p) > 1e-4)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits, chunks = repeat_rows(torch.tensor(values), params, 400)
    drawn = set(sample_ids(Sampler(len(values), CPU, seed=0), logits, chunks))
    assert drawn <= reference_allowed(values, temperature, top_k, top_p, min_p)


def chi_square(counts: Counter, probs: Sequence[float], n: int) -> float:
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


@pytest.mark.parametrize("ops", ["torch", "native"])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "seeded"),
    [
        (0.7, 0, 1.0, False),
        (1.6, 0, 1.0, False),
        (1.0, 4, 1.0, False),
        (1.0, 0, 0.8, False),
        (0.8, 0, 1.0, True),
    ],
)
def test_sampling_distribution_matches_softmax(
    temperature: float, top_k: int, top_p: float, seeded: bool, ops: str
) -> None:
    values = [1.0, 0.4, 0.2, -0.3, -0.6, -1.2]
    n = 3000 if seeded else 20000
    chunks = [
        chunk(
            f"r{i}",
            SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, seed=i if seeded else None
            ),
        )
        for i in range(n)
    ]
    logits = torch.tensor(values).expand(n, -1).contiguous()
    sampler = Sampler(len(values), CPU, seed=3, cpu_kernels=sampler_kernels(ops))
    counts = Counter(sample_ids(sampler, logits, chunks))
    allowed = reference_allowed(values, temperature, top_k, top_p, 0.0)
    z = [v / temperature if i in allowed else -math.inf for i, v in enumerate(values)]
    probs = softmax64(z)
    assert set(counts) <= allowed
    # Degrees of freedom <= 5; 30 is far in the tail (p < 1e-4), so only a real bias fails.
    assert chi_square(counts, probs, n) < 30.0


def test_exponential_noise_is_exp1_and_positive() -> None:
    """The race's noise on the torch path: mean 1, variance 1, P(E > 3) = e^-3, never 0 or inf."""
    out = torch.empty(400_000)
    exponential_(out, torch.Generator().manual_seed(7))
    assert bool(torch.isfinite(out).all()) and float(out.min()) > 0
    assert abs(float(out.mean()) - 1.0) < 0.01
    assert abs(float(out.var()) - 1.0) < 0.02
    assert abs(float((out > 3.0).float().mean()) - math.exp(-3.0)) < 0.002


# ---- penalties, bias, bans ----------------------------------------------------------------------


@st.composite
def penalty_rows(draw: st.DrawFn, vocab: int) -> tuple:
    history = draw(st.lists(st.integers(0, vocab - 1), max_size=24))
    prompt_len = draw(st.integers(0, len(history)))
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 1.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
        frequency_penalty=draw(st.floats(-2, 2)),
        presence_penalty=draw(st.floats(-2, 2)),
        logit_bias=draw(
            st.none() | st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=4)
        ),
    )
    banned = draw(st.lists(st.integers(0, vocab - 1), max_size=3))
    return history, prompt_len, params, banned


@FAST
@given(st.lists(penalty_rows(30), min_size=1, max_size=5), st.integers(0, 2**31))
def test_penalties_bias_and_bans_match_reference(rows: list, seed: int) -> None:
    vocab = 30
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    chunks = [
        chunk(f"r{i}", params, history=history, prompt_len=prompt_len, banned=banned)
        for i, (history, prompt_len, params, banned) in enumerate(rows)
    ]
    sampler = Sampler(vocab, CPU, seed=0)
    out = process_logits(logits.clone(), sampler.prepare(chunks))
    expected = torch.tensor(
        [
            reference_penalties(logits[i].tolist(), history, prompt_len, params, banned)
            for i, (history, prompt_len, params, banned) in enumerate(rows)
        ],
        dtype=torch.float32,
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("penalty", [0.5, 1.2, 3.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    vocab = 50
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, vocab, generator=gen) * 4
    histories = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    chunks = [
        chunk(f"r{i}", params, history=h, prompt_len=len(h) // 2) for i, h in enumerate(histories)
    ]
    out = process_logits(logits.clone(), Sampler(vocab, CPU).prepare(chunks))
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, h in enumerate(histories):
        expected = hf(torch.tensor([h]), logits[i : i + 1].clone())
        torch.testing.assert_close(out[i : i + 1], expected)


def test_bias_and_banned_tokens_steer_random_sampling() -> None:
    vocab = 20
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    sampler = Sampler(vocab, CPU, seed=0)
    forced, chunks = repeat_rows(logits, SamplingParams(logit_bias={7: 100.0}), 300)
    assert set(sample_ids(sampler, forced, chunks)) == {7}
    banned = [int(t) for t in logits.topk(3).indices]
    rows = [chunk(f"r{i}", SamplingParams(temperature=2.0), banned=banned) for i in range(2000)]
    drawn = set(sample_ids(sampler, logits.expand(2000, -1).contiguous(), rows))
    assert not drawn & set(banned)
    assert len(drawn) > 5


@FAST
@given(st.lists(st.sets(st.integers(0, 69), min_size=1), min_size=1, max_size=4))
def test_mask_biases_allow_exactly_the_packed_tokens(rows: list[set[int]]) -> None:
    masks = torch.from_numpy(np.stack([token_mask(ids, 70) for ids in rows]))
    bias = mask_bias(masks, 70)
    assert bias.shape == (len(rows), 70) and bias.dtype == torch.float32
    for row, ids in zip(bias, rows, strict=True):
        assert (row == 0).nonzero().flatten().tolist() == sorted(ids)
        assert (row == float("-inf")).sum() == 70 - len(ids)
        assert mask_allows(token_mask(ids, 70), 70).tolist() == sorted(ids)


def test_allowed_masks_limit_random_and_greedy_rows_and_leave_others_alone() -> None:
    vocab = 70
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(9))
    sampler = Sampler(vocab, CPU, seed=0)
    allowed = [3, 31, 33, 64, 69]  # three words; bit 31 makes word 0 negative
    best = max(allowed, key=lambda t: float(logits[t]))
    rows = [
        chunk(f"r{i}", SamplingParams(temperature=3.0), allowed=allowed, vocab=vocab)
        for i in range(500)
    ]
    rows += [chunk("greedy", SamplingParams(temperature=0), allowed=allowed, vocab=vocab)]
    rows += [chunk(f"free{i}", SamplingParams(temperature=3.0)) for i in range(500)]
    drawn = sample_ids(sampler, logits.expand(len(rows), -1).contiguous(), rows)
    assert set(drawn[:500]) == set(allowed)
    assert drawn[500] == best
    assert len(set(drawn[501:]) - set(allowed)) > 10


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_describe_the_raw_distribution() -> None:
    vocab = 40
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, vocab, generator=gen) * 2
    chunks = [
        chunk("a", SamplingParams(temperature=0.0, logprobs=5)),
        chunk("b", SamplingParams(temperature=0.5, top_k=10, logprobs=0)),
        chunk("c", SamplingParams(temperature=1.0)),
        chunk(
            "d",
            SamplingParams(temperature=1.3, repetition_penalty=1.5, logprobs=20),
            history=[1, 2, 3],
            prompt_len=1,
        ),
        chunk("e", SamplingParams(temperature=1.0, logprobs=2), sample=False),
        chunk("f", SamplingParams(temperature=0.0, logit_bias={0: 50.0}, logprobs=1)),
    ]
    sampler = Sampler(vocab, CPU, seed=0)
    sampled, logprobs = sampler.sample(logits, sampler.prepare(chunks)).to_host(chunks)
    assert set(logprobs) == {"a", "b", "d", "f"}
    reference = torch.log_softmax(logits.double(), dim=-1)
    rows = {"a": 0, "b": 1, "d": 3, "f": 4}
    for rid, row in rows.items():
        entry, lp = logprobs[rid], reference[row]
        assert entry.token_id == sampled[rid]
        assert entry.logprob == pytest.approx(float(lp[entry.token_id]), abs=1e-5)
        assert entry.rank == int((lp >= lp[entry.token_id]).sum())
        n = chunks[[c.request_id for c in chunks].index(rid)].sampling_params.logprobs
        top = lp.topk(n)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert logprobs["a"].rank == 1
    assert sampled["f"] == 0 and logprobs["f"].rank == int((reference[4] >= reference[4][0]).sum())


def test_prompt_logprobs_match_log_softmax() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 30, generator=gen)
    targets = torch.randint(0, 30, (6,), generator=gen).tolist()
    entries = compute_prompt_logprobs(logits, targets, num_top=3)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert [e.token_id for e in entries] == targets
    for i, (entry, target) in enumerate(zip(entries, targets, strict=True)):
        lp = reference[i]
        assert entry.logprob == pytest.approx(float(lp[target]), abs=1e-5)
        assert entry.rank == int((lp >= lp[target]).sum())
        assert [t for t, _ in entry.top] == lp.topk(3).indices.tolist()
    assert compute_prompt_logprobs(logits, [], num_top=0) == []


# ---- contract errors ----------------------------------------------------------------------------


def test_prepare_rejects_what_the_vocabulary_cannot_serve() -> None:
    sampler = Sampler(10, CPU)
    with pytest.raises(ValueError, match="logprobs"):
        sampler.prepare([chunk("a", SamplingParams(logprobs=21))])
    with pytest.raises(ValueError, match="logit_bias"):
        sampler.prepare([chunk("a", SamplingParams(logit_bias={10: 1.0}))])
    with pytest.raises(ValueError, match="history"):
        sampler.prepare([chunk("a", SamplingParams(presence_penalty=1.0))])
    batch = sampler.prepare([chunk("a", SamplingParams())])
    with pytest.raises(ValueError, match="logits"):
        sampler.sample(torch.zeros(2, 10), batch)
    out = sampler.sample(torch.zeros(1, 10), batch)
    with pytest.raises(ValueError, match="chunks"):
        out.to_host([])


def test_empty_batch() -> None:
    sampler = Sampler(10, CPU)
    out = sampler.sample(torch.zeros(0, 10), sampler.prepare([]))
    assert out.to_host([]) == ({}, {})
