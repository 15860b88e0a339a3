"""Mixture-of-experts decoders on CUDA: the triton expert kernels inside captured CUDA graphs
give the tokens transformers gives in float32, and the same tokens as eager execution."""

from __future__ import annotations

import pytest

from aioinfer import LLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_cuda_graphs_with_experts_equal_transformers(tmp_path, variant):
    from tests.offline.test_llm_vs_hf import GREEDY, hf_greedy, make_prompts
    from tests.support.tiny_models import make_variant
    from tests.support.tokenizers import make_tokenizer

    hf = make_variant(variant)
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = make_prompts(0, hf.config.vocab_size)  # 8 requests: decode batches of 1-8 rows
    expected = [hf_greedy(hf, p) for p in prompts]
    for eager in (True, False):
        with LLM(str(tmp_path), dtype="float32", max_model_len=256, enforce_eager=eager,
                 max_num_seqs=16, gpu_memory_utilization=0.3) as llm:  # fmt: skip
            assert (llm.engine.info.graph_capture_seconds is None) == eager
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
