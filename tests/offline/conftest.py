"""Fixtures shared by the tests of the offline LLM."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from aioinfer import LLM
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
