"""`--load-format dummy`: real shapes from a shipped config, random weights, no files."""

from __future__ import annotations

import pytest

from aioinfer import LLM, SamplingParams


@pytest.mark.slow
def test_dummy_qwen2_5_1_5b_loads_and_generates_on_cpu():
    with LLM(
        "Qwen/Qwen2.5-1.5B-Instruct",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=64,
        kv_cache_memory=0.05,
    ) as llm:
        info = llm.engine.info
        assert info.vocab_size == 151936
        assert 2.8 < info.weights_gib < 3.0  # 1.54 B parameters in bf16
        out = llm.generate(
            [[100, 200, 300, 400]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        assert len(out.token_ids) == 3
        assert all(0 <= t < info.vocab_size for t in out.token_ids)
