"""Fixtures shared by the model tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aioinfer import LLM
from aioinfer.model.cpu import kernels as cpu_native
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, Any]]:
    """An offline LLM over a tiny random Llama (context 128), and the transformers model."""
    hf = make_variant("llama")
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=128)
    yield llm, hf
    llm.shutdown()


@pytest.fixture(scope="module", params=["native", "haswell"])
def kernels(request: pytest.FixtureRequest) -> cpu_native.NativeKernels:
    """The build for this machine, and the AVX2 + FMA build (8 lanes) wherever it runs, so an
    AVX-512 machine tests both code paths."""
    built = cpu_native.load(request.param)
    if built is None:
        pytest.skip(cpu_native.unavailable_reason(request.param))
    return built
