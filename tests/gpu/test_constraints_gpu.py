"""Structured outputs on the GPU: the sampler's masks on CUDA tensors, and a JSON schema
through the whole engine with CUDA graphs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from aioinfer import LLM, SamplingParams, StructuredOutputsParams
from aioinfer.core.constraints import token_mask
from aioinfer.gpu.token_masks import mask_bias

pytestmark = pytest.mark.gpu


def test_mask_bias_on_cuda_equals_the_cpu():
    rng = np.random.default_rng(0)
    masks = np.stack([token_mask(rng.choice(1000, 50, replace=False), 1000) for _ in range(5)])
    cpu = mask_bias(torch.from_numpy(masks), 1000)
    cuda = mask_bias(torch.from_numpy(masks).cuda(), 1000)
    assert torch.equal(cuda.cpu(), cpu)


def test_json_schema_through_the_engine(tmp_path):
    pytest.importorskip("xgrammar")  # JSON schemas compile through it; the test above does not
    from tests.support.tiny_models import make_variant
    from tests.support.tokenizers import make_tokenizer

    make_variant("qwen2").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=60, n=4,
        structured_outputs=StructuredOutputsParams(json=schema),
    )  # fmt: skip
    with LLM(str(tmp_path), dtype="float32", max_model_len=256, gpu_memory_utilization=0.3) as llm:
        outs = llm.generate([[5, 6, 7], [9] * 20], params, use_tqdm=False)
    finished = [seq for out in outs for seq in out.outputs if seq.finish_reason == "stop"]
    assert finished
    for seq in finished:
        value = json.loads(seq.text)
        assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
