"""The whole engine (scheduler, GPU thread, runner, sampler) against Hugging Face transformers:
greedy outputs must be equal token for token, in float32, under chunked prefill, prefix-cache
hits and forced preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.model.cpu import kernels as cpu_native
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3-tied"])
def model_dir(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    hf = make_variant(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path, hf


def make_prompts(seed: int, vocab: int, lengths=(1, 3, 7, 16, 17, 33, 50, 64)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(max_new):
        token = int(hf(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def run_llm(path, prompts, **options) -> list[list[int]]:
    options = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128, **options}
    with LLM(str(path), **options) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        scheduler = llm.engine.scheduler
        assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_usable_blocks
        stats = (scheduler.num_preemptions, scheduler.kv.stats.hits)
    run_llm.last_stats = stats  # type: ignore[attr-defined]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_batch_equals_transformers(model_dir, backend):
    """Both CPU paths: the torch reference ops and the native kernels (linears and decode
    attention); the other tests run the default, native where it builds."""
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    path, hf = model_dir
    prompts = make_prompts(0, hf.config.vocab_size)
    with LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=128,
             attention_backend=backend, cpu_kernels=backend) as llm:  # fmt: skip
        info = llm.engine.info
        assert (info.attention_backend, info.cpu_kernels) == (backend, backend)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


def test_chunked_prefill_with_a_small_budget(model_dir):
    path, hf = model_dir
    prompts = make_prompts(1, hf.config.vocab_size)
    got = run_llm(path, prompts, max_num_batched_tokens=8)
    assert got == [hf_greedy(hf, p) for p in prompts]


def test_prefix_cache_hits(model_dir):
    path, hf = model_dir
    rng = random.Random(2)
    shared = [rng.randrange(3, hf.config.vocab_size) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 20)]
    prompts += [prompts[0], prompts[1]]  # the same prompt twice
    # One request per step for the first two, so later ones find full blocks cached.
    got = run_llm(path, prompts, max_num_seqs=1)
    assert run_llm.last_stats[1] > 0  # type: ignore[attr-defined]
    assert got == [hf_greedy(hf, p) for p in prompts]


def test_forced_preemption(model_dir):
    path, hf = model_dir
    prompts = make_prompts(3, hf.config.vocab_size, lengths=(20, 30, 40, 50, 25, 35))
    # 10 blocks of 16 = 144 usable tokens: more than max_model_len, less than the batch needs.
    got = run_llm(path, prompts, num_gpu_blocks_override=10)
    assert run_llm.last_stats[0] > 0  # type: ignore[attr-defined]
    assert got == [hf_greedy(hf, p) for p in prompts]
