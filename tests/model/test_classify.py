"""Classifiers (`*ForSequenceClassification`) through the whole engine against transformers in
float32: class probabilities (LLM.classify) and cross-encoder scores (LLM.score) of the last
token's logits, under chunked prefill and prefix-cache hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen3Config,
    Qwen3ForSequenceClassification,
)

from aioinfer import LLM
from aioinfer.model.cpu import kernels as cpu_native
from tests.offline.test_llm_vs_hf import make_prompts
from tests.support.tiny_models import ARCH_CONFIG, BASE_CONFIG, _randomize
from tests.support.tokenizers import make_tokenizer

OPTIONS = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def make_classifier(config_cls, model_cls, path: Path, **overrides) -> torch.nn.Module:
    config = config_cls(**{**BASE_CONFIG, **overrides}, attn_implementation="eager")
    config.architectures = [model_cls.__name__]
    config.pad_token_id = None  # one prompt at a time: the last token is the last position
    torch.manual_seed(0)
    hf = model_cls(config).float().eval()
    _randomize(hf, 0)
    hf.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def sentiment(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("sentiment")
    hf = make_classifier(
        Qwen3Config, Qwen3ForSequenceClassification, path, **ARCH_CONFIG["qwen3"],
        num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
    )  # fmt: skip
    return path, hf


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("cross-encoder")
    return path, make_classifier(LlamaConfig, LlamaForSequenceClassification, path, num_labels=1)


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_class_probabilities_equal_transformers(sentiment, backend):
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    path, hf = sentiment
    prompts = make_prompts(0, hf.config.vocab_size)
    # A budget of 16 tokens: the longer prompts are classified over several chunks.
    options = {**OPTIONS, "max_num_batched_tokens": 16}
    with LLM(str(path), attention_backend=backend, cpu_kernels=backend, **options) as llm:
        assert llm.engine.pooler is not None and llm.engine.pooler.labels == tuple(LABELS.values())
        outputs = llm.classify(prompts, use_tqdm=False)
        again = llm.classify(prompts[-2:], use_tqdm=False)  # their prefixes now cached
        assert llm.engine.scheduler.kv.stats.hits > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = torch.softmax(hf_logits(hf, prompt), -1)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=1e-5, rtol=0)
    for first, second in zip(outputs[-2:], again, strict=True):
        torch.testing.assert_close(
            torch.tensor(second.outputs.probs), torch.tensor(first.outputs.probs), atol=1e-6, rtol=0
        )


def test_a_cross_encoder_scores_pairs_as_transformers(cross_encoder):
    path, hf = cross_encoder
    tokenizer = make_tokenizer()
    query, documents = "where is the fox", ["the quick brown fox", "a lazy dog", "nowhere"]
    with LLM(str(path), **OPTIONS) as llm:
        one_to_many = llm.score(query, documents, use_tqdm=False)
        pairwise = llm.score(documents[:2], [query, query], use_tqdm=False)
        probs = llm.classify([query], use_tqdm=False)[0].outputs.probs
    for output, document in zip(one_to_many, documents, strict=True):
        ids = tokenizer(query, document)["input_ids"]
        assert output.prompt_token_ids == ids
        expected = torch.sigmoid(hf_logits(hf, ids))[0].item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
    ids = tokenizer(documents[1], query)["input_ids"]
    assert pairwise[1].outputs.score == pytest.approx(
        torch.sigmoid(hf_logits(hf, ids))[0].item(), abs=1e-5
    )
    assert len(probs) == 1  # one label: its sigmoid


def test_a_classifier_neither_embeds_nor_generates(sentiment):
    path, _ = sentiment
    with LLM(str(path), **OPTIONS) as llm:
        with pytest.raises(ValueError, match=r"LLM\.classify"):
            llm.embed(["hi"], use_tqdm=False)
        with pytest.raises(ValueError, match="one label"):
            llm.score("a", ["b"], use_tqdm=False)
    with pytest.raises(ValueError, match="is a classifier"):
        LLM(str(path), runner="generate", **OPTIONS)
    with pytest.raises(ValueError, match="last token"):
        LLM(str(path), pooler_config={"pooling_type": "MEAN"}, **OPTIONS)
    with LLM(str(path), pooler_config={"pooling_type": "last"}, **OPTIONS) as llm:
        assert llm.engine.pooler is not None and llm.engine.pooler.classifies


def test_trailing_pad_tokens_are_not_scored(tmp_path):
    """As transformers: the last token that is not the pad id is scored (reward models whose
    pad is their end-of-turn token, which their template puts last)."""
    hf = make_classifier(LlamaConfig, LlamaForSequenceClassification, tmp_path, num_labels=2)
    hf.config.pad_token_id = 2
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "pad_token_id": 2}))
    prompts = [[1, 5, 9, 17, 2], [1, 5, 9, 17, 2, 2], [2, 2], [7, 2, 8]]
    with LLM(str(tmp_path), **OPTIONS) as llm:
        outputs = llm.classify(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = torch.softmax(hf_logits(hf, prompt), -1)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=1e-5, rtol=0)


def test_a_truncated_pair_keeps_both_texts(cross_encoder):
    path, hf = cross_encoder
    tokenizer = make_tokenizer()
    query, document = "where is the quick brown fox", "the quick brown fox jumps over the lazy dog"
    with LLM(str(path), **OPTIONS) as llm:
        (output,) = llm.score(query, [document], truncate_prompt_tokens=10, use_tqdm=False)
    ids = tokenizer(query, document, truncation=True, max_length=10)["input_ids"]
    assert output.prompt_token_ids == ids and ids[:2] == tokenizer(query)["input_ids"][:2]
    expected = torch.sigmoid(hf_logits(hf, ids))[0].item()
    assert output.outputs.score == pytest.approx(expected, abs=1e-5)
