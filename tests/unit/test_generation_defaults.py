"""Sampling defaults: generation_config.json's (unless --generation-config vllm), under
--override-generation-config, which is checked when the config is built."""

from __future__ import annotations

import pytest

from aioinfer.config import ModelConfig
from aioinfer.gpu.runner import _default_sampling

FILE = {"temperature": 0.7, "top_p": 0.8, "eos_token_id": 2, "do_sample": True}


def test_defaults_from_the_file_under_the_overrides():
    assert _default_sampling(FILE, ModelConfig()) == {"temperature": 0.7, "top_p": 0.8}
    capped = {**FILE, "max_new_tokens": 7}  # vLLM's cap on max_tokens
    assert _default_sampling(capped, ModelConfig())["max_tokens"] == 7
    config = ModelConfig(override_generation_config='{"temperature": 0.2, "max_new_tokens": 64}')
    assert _default_sampling(FILE, config) == {"temperature": 0.2, "top_p": 0.8, "max_tokens": 64}
    ignored = ModelConfig(generation_config="vllm", override_generation_config='{"top_k": 5}')
    assert _default_sampling(FILE, ignored) == {"top_k": 5}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("[1]", "JSON object"), ("{", "JSON object"), ('{"seed": 1}', "'seed'"),
     ('{"temperature": "hot"}', "temperature must be a number"),
     ('{"top_k": true}', "top_k must be a number"),
     # Ranges, at start, rather than a 400 for every request that sets nothing.
     ('{"temperature": -1}', "temperature must be >= 0"), ('{"top_p": 0}', "top_p"),
     ('{"top_k": 1.5}', "top_k"), ('{"max_new_tokens": 0}', "max_tokens"),
     ('{"temperature": NaN}', "finite")],
)  # fmt: skip
def test_bad_overrides_are_refused_at_start(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        ModelConfig(override_generation_config=text)


def test_code_may_give_a_dict():
    """As vLLM's LLM(..., override_generation_config={...}) does."""
    config = ModelConfig(override_generation_config={"temperature": 0.5})
    assert config.generation_overrides == {"temperature": 0.5}
