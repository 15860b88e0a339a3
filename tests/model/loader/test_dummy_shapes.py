"""`--load-format dummy`: real shapes from a shipped config, random weights, no files."""

from __future__ import annotations

import pytest
import torch

from aioinfer import LLM, SamplingParams
from tests.model.loader.test_loader import _expected_param_count


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
        # Materialised on the CPU in bfloat16, every parameter the config implies.
        params = list(llm.engine.gpu.runner.model.parameters())
        assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params)
        config = llm.engine.gpu.runner.hf_config
        assert sum(p.numel() for p in params) == _expected_param_count(config)
        out = llm.generate(
            [[100, 200, 300, 400]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        assert len(out.token_ids) == 3
        assert all(0 <= t < info.vocab_size for t in out.token_ids)
