"""CUDA graph replay must give exactly the tokens eager execution gives."""

from __future__ import annotations

import pytest

from aioinfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_graph_replay_equals_eager(tmp_path):
    from tests.support.tiny_models import make_variant
    from tests.support.tokenizers import make_tokenizer

    make_variant("qwen2").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(11)]  # 11 requests: a padded bucket (16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for eager in (True, False):
        with LLM(str(tmp_path), dtype="float32", max_model_len=256, enforce_eager=eager,
                 max_num_seqs=32, gpu_memory_utilization=0.3) as llm:  # fmt: skip
            assert (llm.engine.info.graph_capture_seconds is None) == eager
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]
