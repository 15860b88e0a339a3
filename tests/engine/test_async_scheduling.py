"""Overlapped steps (--async-scheduling) on a real tiny model on the CPU, where the native
kernels release the interpreter lock and the loop plans step N+1 while the GPU thread runs N:
the outputs are those of one step at a time, token for token."""

from __future__ import annotations

import pytest

from aioinfer import LLM, SamplingParams
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

PROMPTS = [[5 + i, 17, 300 + i] * (2 + i) for i in range(6)]
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
    "stops": SamplingParams(temperature=0, max_tokens=30, min_tokens=2, stop=["a", "e"]),
    "logprobs": SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
    "penalties": SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_variant("qwen2").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def run(model_dir, overlap: bool, params: list[SamplingParams]):
    with LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory=0.01,
             max_num_seqs=4, async_scheduling=overlap, seed=0) as llm:  # fmt: skip
        fed = []
        llm.engine._step_loop.on_step = lambda plan, result, elapsed: fed.extend(
            c for c in plan.chunks if c.previous_token
        )
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert bool(fed) == overlap  # the loop did plan steps ahead
        kv = llm.engine.scheduler.kv
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
        return [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             [dict(lp) for lp in o.outputs[0].logprobs or []])
            for o in outs
        ]  # fmt: skip


def test_outputs_are_the_same_with_steps_overlapped(model_dir):
    # A mix in one batch: 4 running at a time, so requests join and leave while steps overlap.
    params = [CASES[name] for name in ("greedy", "seeded", "stops", "logprobs", "greedy", "seeded")]
    assert run(model_dir, True, params) == run(model_dir, False, params)


def test_a_request_with_penalties_makes_its_steps_wait(model_dir):
    params = [CASES["penalties"], CASES["greedy"]] * 3
    assert run(model_dir, True, params) == run(model_dir, False, params)
