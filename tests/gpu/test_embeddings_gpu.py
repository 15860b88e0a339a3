"""Embeddings on CUDA: the memory profile and the step without an LM head, and the vectors of
the float32 GPU path beside the CPU's (bfloat16 within its rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from aioinfer import LLM

pytestmark = pytest.mark.gpu


def test_cuda_embeddings_equal_the_cpus(tmp_path):
    from tests.support.tiny_models import make_variant
    from tests.support.tokenizers import make_tokenizer

    decoder = make_variant("qwen3").model
    decoder.config.architectures = ["Qwen3Model"]
    decoder.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(11)]
    vectors = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        options = {"kv_cache_memory": 0.01} if device == "cpu" else {"gpu_memory_utilization": 0.3}
        with LLM(str(tmp_path), device=device, dtype=dtype, max_model_len=256, **options) as llm:
            assert llm.engine.info.graph_capture_seconds is None  # nothing decodes
            outputs = llm.embed(prompts, use_tqdm=False)
            vectors[device, dtype] = np.stack([o.outputs.data for o in outputs])
    reference = vectors["cpu", "float32"]
    np.testing.assert_allclose(vectors["cuda", "float32"], reference, atol=1e-4)
    np.testing.assert_allclose(vectors["cuda", "bfloat16"], reference, atol=5e-2)
