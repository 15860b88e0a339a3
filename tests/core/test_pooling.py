"""Embeddings without a model: the pooling math, the pooler a folder or flag asks for, the
scheduler's pooling requests (chunked, preempted, mixed with generation) and the engine's
encode() over the fake runner, whose hidden states read the KV cache back."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioinfer.config import NgramSpeculation
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.pooling import (
    PoolerConfig,
    PoolingParams,
    cosine,
    embedding,
    fold,
    resolve_pooler,
)
from aioinfer.core.request import Request
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.scheduler import Scheduler
from aioinfer.engine.stream import RequestAbortedError
from aioinfer.server.pooling.scores_protocol import ranked
from tests.core.test_scheduler import make_request, run_to_completion
from tests.engine.test_engine import FakeRunnerFactory, make_engine
from tests.server.conftest import build_engine
from tests.support.fake_runner import FAKE_HIDDEN, FakeRunner, reference_output, reference_pooled

TYPES = ("LAST", "MEAN", "CLS")


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


# ----------------------------------------------------------------- the math


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    cuts=st.lists(st.integers(1, 39), max_size=6),
    pooling=st.sampled_from(TYPES),
    dims=st.one_of(st.none(), st.integers(1, 8)),
    normalize=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_folded_chunk_parts_give_the_whole_prompts_embedding(
    num_tokens, cuts, pooling, dims, normalize, seed
):
    rows = np.random.default_rng(seed).normal(size=(num_tokens, 8)).astype(np.float32)
    bounds = sorted({0, num_tokens, *(c for c in cuts if c < num_tokens)})
    folded = None
    for start, end in itertools.pairwise(bounds):
        chunk = rows[start:end]
        part = {"MEAN": chunk.sum(0), "LAST": chunk[-1], "CLS": chunk[0] if start == 0 else None}
        folded = fold(pooling, folded, part[pooling])
    config = PoolerConfig(pooling, normalize=not normalize)
    got = embedding(folded, num_tokens, PoolingParams(dims, normalize), config)
    whole = {"MEAN": rows.astype(np.float64).mean(0), "LAST": rows[-1], "CLS": rows[0]}[pooling]
    expected = whole[:dims] if dims else whole
    if normalize:  # the request's setting wins over the model's
        expected = unit(expected)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_zero_vector_stays_zero_when_normalized():
    got = embedding(np.zeros(4), 3, PoolingParams(), PoolerConfig())
    assert np.array_equal(got, np.zeros(4, dtype=np.float32))


def test_cosine_is_bounded_and_a_broken_vector_is_not_hidden():
    v = np.random.default_rng(0).normal(size=64).astype(np.float32)
    assert cosine(v, v) == 1.0 and cosine(v, -v) == -1.0  # not 1.0000000000000002
    assert cosine(v, np.zeros(64)) == 0.0
    assert math.isnan(cosine(v, np.full(64, np.nan))) and math.isnan(cosine(v, v * np.inf))
    scores = [0.5, math.nan, 0.1, 0.9]
    assert [r["index"] for r in ranked(list("abcd"), scores, None, False)] == [3, 0, 2, 1]


def test_params_refuse_what_cannot_be():
    with pytest.raises(ValueError, match="dimensions must be >= 1, got 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    # Of the wrong type: 2.5 dimensions once failed after the model's work, "no" normalized.
    for field, value in (("dimensions", 2.5), ("truncate_prompt_tokens", 2.5), ("normalize", "no")):
        with pytest.raises(ValueError, match=f"{field} must be"):
            PoolingParams(**{field: value})
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig("MAX")


# ----------------------------------------------------------------- which pooler


def sentence_transformers_folder(
    path: Path, modes: dict[str, bool], normalize: bool = True, dense: bool = False
) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if dense:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
        )
    if normalize:
        modules.append(
            {
                "idx": 3,
                "name": "3",
                "path": "3_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **modes})
    )
    return path


def test_auto_follows_the_architecture_and_sentence_transformers_files(tmp_path):
    assert resolve_pooler("auto", None, "Qwen3ForCausalLM", tmp_path) is None
    assert resolve_pooler("auto", None, "Qwen3Model", tmp_path) == PoolerConfig("LAST", True)
    assert resolve_pooler("pooling", None, "LlamaForCausalLM", None) == PoolerConfig()
    assert resolve_pooler("generate", None, "Qwen3ForCausalLM", tmp_path) is None
    folder = sentence_transformers_folder(
        tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}, False
    )
    # Qwen3-Embedding's config names a causal LM; its sentence-transformers files decide.
    assert resolve_pooler("auto", None, "Qwen3ForCausalLM", folder) == PoolerConfig("MEAN", False)
    assert resolve_pooler("generate", None, "Qwen3ForCausalLM", folder) is None


def test_the_flag_wins_over_the_folder(tmp_path):
    folder = sentence_transformers_folder(tmp_path, {"pooling_mode_lasttoken": True})
    assert resolve_pooler("auto", {"pooling_type": "cls"}, "X", folder) == PoolerConfig("CLS")
    assert resolve_pooler("pooling", {"normalize": False}, "X", folder) == PoolerConfig(
        "LAST", False
    )
    # A GGUF's declared type stands where no folder speaks, under the flag.
    assert resolve_pooler("auto", None, "Qwen3Model", None, "MEAN") == PoolerConfig("MEAN")
    assert resolve_pooler("auto", {"pooling_type": "CLS"}, "Qwen3Model", None, "MEAN") == (
        PoolerConfig("CLS")
    )


@pytest.mark.parametrize(
    ("runner", "override", "architecture", "message"),
    [
        ("generate", {"pooling_type": "MEAN"}, "LlamaModel", "pooler_config needs --runner"),
        ("auto", {"pooling_type": "MEAN"}, "LlamaForCausalLM", "text-generation architecture"),
        ("pooling", {"pooling": "MEAN"}, "LlamaModel", "may set pooling_type and normalize"),
        ("pooling", {"normalize": 1}, "LlamaModel", "normalize must be true or false"),
        ("pooling", {"pooling_type": "MAX"}, "LlamaModel", "pooling_type must be one of"),
        ("embed", None, "LlamaModel", "runner must be one of"),
    ],
)
def test_bad_runner_settings_are_refused(runner, override, architecture, message):
    with pytest.raises(ValueError, match=message):
        resolve_pooler(runner, override, architecture, None)


def test_generate_reads_no_sentence_transformers_files(tmp_path):
    """A causal LM that also ships files the pooling runner cannot apply still generates."""
    sentence_transformers_folder(tmp_path, {"pooling_mode_lasttoken": True}, dense=True)
    assert resolve_pooler("generate", None, "LlamaForCausalLM", tmp_path) is None
    with pytest.raises(ValueError, match="--runner generate serves the model for text"):
        resolve_pooler("auto", None, "LlamaForCausalLM", tmp_path)
    (tmp_path / "modules.json").write_text("{not json")
    assert resolve_pooler("generate", None, "LlamaForCausalLM", tmp_path) is None
    with pytest.raises(ValueError, match=r"cannot read .*modules\.json"):
        resolve_pooler("pooling", None, "LlamaForCausalLM", tmp_path)


def test_pooling_without_the_prompt_is_refused(tmp_path):
    sentence_transformers_folder(
        tmp_path, {"pooling_mode_mean_tokens": True, "include_prompt": False}
    )
    with pytest.raises(ValueError, match="include_prompt: false"):
        resolve_pooler("auto", None, "Qwen3ForCausalLM", tmp_path)


def test_sentence_transformers_modules_the_runner_cannot_apply_are_refused(tmp_path):
    dense = tmp_path / "dense"
    dense.mkdir()
    sentence_transformers_folder(dense, {"pooling_mode_lasttoken": True}, dense=True)
    with pytest.raises(ValueError, match=r"not supported: \['Dense'\]"):
        resolve_pooler("auto", None, "Qwen3ForCausalLM", dense)
    two = tmp_path / "two"
    two.mkdir()
    sentence_transformers_folder(
        two, {"pooling_mode_lasttoken": True, "pooling_mode_max_tokens": True}
    )
    with pytest.raises(ValueError, match="must be exactly one of"):
        resolve_pooler("auto", None, "Qwen3ForCausalLM", two)


# ----------------------------------------------------------------- the scheduler


def pooling_request(rid: str, prompt: list[int], pooling: str) -> Request:
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=1, detokenize=False),
        max_tokens=1,
        pooler=PoolerConfig(pooling),
    )


@pytest.mark.parametrize("seed", range(8))
def test_pooling_requests_among_generation_under_chunking_and_preemption(seed):
    """Every embedding equals the whole prompt's, whatever the chunks, preemptions and
    neighbours; generation is unchanged beside them; every block comes back."""
    rng = random.Random(seed)
    kv = KVCacheManager(rng.randint(14, 24), 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.randint(4, 24))
    runner = FakeRunner(kv.pool.num_blocks, 4)
    shared = [rng.randrange(3, 50) for _ in range(12)]  # prefix-cache hits for some
    pooled: dict[str, tuple[list[int], str]] = {}
    generated: dict[str, list[int]] = {}
    for i in range(10):
        prompt = shared[: rng.randint(0, 12)] + [
            rng.randrange(3, 50) for _ in range(rng.randint(1, 30))
        ]
        rid = f"r{i}"
        if rng.random() < 0.6:
            pooling = rng.choice(TYPES)
            pooled[rid] = (prompt, pooling)
            sched.add(pooling_request(rid, prompt, pooling))
        else:
            generated[rid] = prompt
            sched.add(make_request(rid, prompt, max_tokens=6, ignore_eos=True))
    finished: dict[str, Request] = {}
    requests = dict(sched.requests)

    def record(_step: int) -> None:
        for rid, request in requests.items():
            if request.is_finished:
                finished[rid] = request

    outputs, reasons = run_to_completion(sched, runner, on_step=record)
    for rid, (prompt, pooling) in pooled.items():
        request = finished[rid]
        assert reasons[rid] == "stop" and request.output_token_ids == []
        assert outputs.get(rid, []) == []
        got = embedding(request.pooled, len(prompt), PoolingParams(), PoolerConfig(pooling))
        np.testing.assert_allclose(got, unit(reference_pooled(prompt, pooling)), rtol=1e-5)
    for rid, prompt in generated.items():
        assert outputs[rid] == reference_output(prompt, 6)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    for plan in runner.plans:
        for chunk in plan.chunks:
            if chunk.request_id in pooled:
                assert not chunk.sample and chunk.draft_token_ids == ()


def test_last_pooling_reuses_cached_prefixes_and_mean_never_does():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(64, 4)
    prompt = list(range(3, 23))  # five full blocks
    for rid, pooling in (("a", "LAST"), ("b", "LAST"), ("c", "MEAN"), ("d", "CLS")):
        request = pooling_request(rid, prompt, pooling)
        sched.add(request)
        run_to_completion(sched, runner)
        expected = unit(reference_pooled(prompt, pooling))
        got = embedding(request.pooled, len(prompt), PoolingParams(), PoolerConfig(pooling))
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        # The second LAST request reads four cached blocks; MEAN and CLS compute every token.
        assert request.num_cached_tokens == {"a": 0, "b": 16, "c": 0, "d": 0}[rid]


def test_pooling_requests_get_no_drafts():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    spec = NgramSpeculation(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=5, speculation=spec)
    runner = FakeRunner(64, 4)
    # A repeating prompt, whose last chunk is one token: a decoding request would draft here.
    sched.add(pooling_request("p", [5, 6, 5, 6, 5, 6], "LAST"))
    run_to_completion(sched, runner)
    assert all(c.draft_token_ids == () for plan in runner.plans for c in plan.chunks)
    assert [c.num_tokens for plan in runner.plans for c in plan.chunks] == [5, 1]


# ----------------------------------------------------------------- the engine


async def pooling_engine(pooling: str = "LAST", **sched):
    return await make_engine(FakeRunnerFactory(pooler=PoolerConfig(pooling)), **sched)


@pytest.mark.parametrize("pooling", TYPES)
async def test_encode_returns_the_prompts_embedding(pooling):
    engine = await pooling_engine(pooling, max_num_batched_tokens=8)
    try:
        prompts = [[3 + (7 * i + j) % 40 for j in range(5 + 9 * i)] for i in range(4)]
        outputs = await asyncio.gather(*(engine.encode(p) for p in prompts))
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.prompt_token_ids == prompt
            np.testing.assert_allclose(
                output.outputs.embedding, unit(reference_pooled(prompt, pooling)), rtol=1e-5
            )
        cut = await engine.encode(prompts[3], PoolingParams(dimensions=2, normalize=False))
        np.testing.assert_allclose(
            cut.outputs.data, reference_pooled(prompts[3], pooling)[:2], rtol=1e-5
        )
        assert engine.stats.finished == {"stop": 5} and engine.stats.generation_tokens == 0
        assert engine.num_unfinished == 0
        kv = engine.scheduler.kv
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    finally:
        await engine.shutdown()


async def test_encode_refuses_what_does_not_fit():
    engine = await pooling_engine()
    try:
        # A whole context of input is fine: nothing is generated after it.
        full = await engine.encode([5] * engine.max_model_len)
        assert len(full.outputs.embedding) == FAKE_HIDDEN
        with pytest.raises(ValueError, match="you requested 129 tokens in the input"):
            await engine.encode([5] * 129)
        kept = await engine.encode([9] * 200, PoolingParams(truncate_prompt_tokens=-1))
        assert len(kept.prompt_token_ids) == engine.max_model_len
        with pytest.raises(ValueError, match=f"dimensions must be <= {FAKE_HIDDEN}"):
            await engine.encode([5, 6], PoolingParams(dimensions=FAKE_HIDDEN + 1))
        with pytest.raises(ValueError, match="must not be empty"):
            await engine.encode([])
        with pytest.raises(ValueError, match="token ids must be in"):
            await engine.encode([5, 10**6])
        with pytest.raises(ValueError, match="does not generate text"):
            engine.add_request([5, 6], SamplingParams(max_tokens=2))
        assert engine.num_unfinished == 0
    finally:
        await engine.shutdown()


async def test_a_text_generation_engine_refuses_embeddings():
    engine = await make_engine()
    try:
        with pytest.raises(ValueError, match="does not serve embeddings"):
            await engine.encode([5, 6])
    finally:
        await engine.shutdown()


async def test_shutdown_while_waiting_raises_instead_of_a_vector():
    engine = await pooling_engine(max_num_batched_tokens=4)
    task = asyncio.ensure_future(engine.encode([5] * 120))
    await asyncio.sleep(0)
    await engine.shutdown()
    with pytest.raises(RequestAbortedError):
        await task


async def test_a_cancelled_caller_aborts_its_request():
    # 20 ms a step: the 30 steps of this prompt take long enough to cancel in the middle.
    engine = await build_engine(step_delay=0.02, pooler=PoolerConfig(), max_num_batched_tokens=4)
    try:
        task = asyncio.ensure_future(engine.encode([5] * 120))
        while engine.scheduler.num_running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_unfinished == 0 and engine.stats.aborted == 1
        kv = engine.scheduler.kv
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    finally:
        await engine.shutdown()
