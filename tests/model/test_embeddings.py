"""Embeddings of tiny random decoders against Hugging Face transformers in float32: the final
hidden states pooled (last token, mean, first token) and normalized as sentence-transformers
does, under chunked prefill and prefix caching, on both CPU paths."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.core.pooling import PoolingParams
from aioinfer.model.cpu import kernels as cpu_native
from tests.core.test_pooling import sentence_transformers_folder
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

OPTIONS = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128}


def prompts(seed: int, lengths=(1, 2, 9, 16, 17, 40, 77)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_pooled(decoder: torch.nn.Module, prompt: list[int], pooling: str, normalize: bool = True):
    """sentence-transformers' pooling over transformers' final hidden states."""
    hidden = decoder(torch.tensor([prompt])).last_hidden_state[0].double()
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0).numpy() if normalize else vector.numpy()


@pytest.fixture(scope="module")
def bare_qwen3(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A Qwen3Model checkpoint, as embedding models ship: no LM head, keys without `model.`."""
    decoder = make_variant("qwen3").model
    decoder.config.architectures = ["Qwen3Model"]
    path = tmp_path_factory.mktemp("qwen3-embedding")
    decoder.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path, decoder


@pytest.fixture(scope="module")
def causal_llama(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A Llama causal LM with its own (untied) LM head in the checkpoint."""
    hf = make_variant("llama")
    path = tmp_path_factory.mktemp("llama-causal")
    hf.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path, hf.model


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_last_token_embeddings_equal_transformers(bare_qwen3, backend):
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    path, decoder = bare_qwen3
    batch = prompts(0)
    # A budget of 16 tokens: the longer prompts are pooled over several chunks.
    options = {**OPTIONS, "attention_backend": backend, "cpu_kernels": backend}
    with LLM(str(path), max_num_batched_tokens=16, **options) as llm:
        assert llm.engine.pooler is not None and llm.engine.pooler.pooling_type == "LAST"
        assert llm.engine.gpu.runner.model.lm_head is None
        outputs = llm.embed(batch, use_tqdm=False)
        again = llm.embed(batch, use_tqdm=False)  # now from the prefix cache, all but one token
        assert llm.engine.scheduler.kv.stats.hits > 0
        kv = llm.engine.scheduler.kv
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    for prompt, output, cached in zip(batch, outputs, again, strict=True):
        expected = hf_pooled(decoder, prompt, "LAST")
        assert output.prompt_token_ids == prompt
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=2e-5)
        np.testing.assert_allclose(cached.outputs.data, output.outputs.data, atol=2e-5)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_mean_and_first_token_pooling_of_a_causal_lm(causal_llama, pooling):
    path, decoder = causal_llama
    batch = prompts(1)
    config = {"pooling_type": pooling, "normalize": pooling == "CLS"}
    with LLM(
        str(path), runner="pooling", pooler_config=config, max_num_batched_tokens=16, **OPTIONS
    ) as llm:
        assert llm.engine.gpu.runner.model.lm_head is None  # the checkpoint's head is skipped
        outputs = llm.embed(batch, use_tqdm=False)
        cut = llm.embed(batch[-1], PoolingParams(dimensions=8, normalize=True), use_tqdm=False)
        with pytest.raises(ValueError, match="serves embeddings"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    for prompt, output in zip(batch, outputs, strict=True):
        expected = hf_pooled(decoder, prompt, pooling, normalize=pooling == "CLS")
        np.testing.assert_allclose(output.outputs.data, expected, rtol=1e-5, atol=2e-5)
    full = hf_pooled(decoder, batch[-1], pooling, normalize=False)[:8]
    np.testing.assert_allclose(cut[0].outputs.data, full / np.linalg.norm(full), atol=2e-5)


def test_a_sentence_transformers_folder_serves_embeddings_by_itself(tmp_path):
    """auto: a causal-LM config with sentence-transformers files (as Qwen3-Embedding ships)
    pools as its files say, here mean pooling without normalization."""
    hf = make_variant("qwen2-tied")
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    sentence_transformers_folder(
        tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}, False
    )
    text = "the quick brown fox"
    with LLM(str(tmp_path), **OPTIONS) as llm:
        [output] = llm.embed(text, use_tqdm=False)
    ids = make_tokenizer()(text)["input_ids"]
    assert output.prompt_token_ids == ids and output.prompt == text
    expected = hf_pooled(hf.model, ids, "MEAN", normalize=False)
    np.testing.assert_allclose(output.outputs.data, expected, rtol=1e-5, atol=2e-5)


def test_text_generation_refuses_a_decoder_without_lm_head(bare_qwen3):
    path, _ = bare_qwen3
    with pytest.raises(ValueError, match="without an LM head: it makes embeddings"):
        LLM(str(path), runner="generate", **OPTIONS)


def test_embed_on_a_text_generation_model_is_refused(causal_llama):
    path, _ = causal_llama
    with LLM(str(path), **OPTIONS) as llm, pytest.raises(ValueError, match="does not serve"):
        llm.embed("hello", use_tqdm=False)


def test_score_is_the_cosine_of_transformers_embeddings(bare_qwen3):
    path, decoder = bare_qwen3
    query, docs = prompts(2, lengths=(5,))[0], prompts(3, lengths=(3, 8, 21))
    with LLM(str(path), **OPTIONS) as llm:
        one_to_many = llm.score(
            {"prompt_token_ids": query}, [{"prompt_token_ids": d} for d in docs]
        )
        pairwise = llm.score([docs[0], docs[1]], [docs[1], docs[1]], use_tqdm=False)
        with pytest.raises(ValueError, match="data_1 must be one text or as many as data_2"):
            llm.score(docs[:2], docs)
    q = hf_pooled(decoder, query, "LAST")
    expected = [float(q @ hf_pooled(decoder, d, "LAST")) for d in docs]
    np.testing.assert_allclose([o.outputs.score for o in one_to_many], expected, atol=2e-5)
    assert one_to_many[0].prompt_token_ids == query + docs[0]
    cross = float(hf_pooled(decoder, docs[0], "LAST") @ hf_pooled(decoder, docs[1], "LAST"))
    np.testing.assert_allclose([o.outputs.score for o in pairwise], [cross, 1.0], atol=2e-5)


@pytest.mark.parametrize("cached", [False, True])
def test_an_embedding_gguf_pools_as_it_declares(tmp_path, monkeypatch, cached):
    """A GGUF with `<arch>.pooling_type` (llama.cpp's embedding models) runs as the bare
    decoder with that pooling, straight from the file or from its converted cache."""
    import gguf

    from tests.model.loader.test_loader import write_gguf

    monkeypatch.setenv("AIOINFER_GGUF_CACHE", "1" if cached else "0")
    monkeypatch.setenv("AIOINFER_CACHE", str(tmp_path / "cache"))
    hf = make_variant("qwen3-tied")
    original = gguf.GGUFWriter.write_header_to_file

    def with_pooling(writer, *args, **kwargs):
        writer.add_pooling_type(gguf.PoolingType.MEAN)
        return original(writer, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_pooling)
    path = write_gguf(hf, tmp_path / "Tiny-Embed-F32.gguf", "qwen3")
    batch = prompts(4, lengths=(3, 30))
    with LLM(str(path), tokenizer_object=make_tokenizer(), **OPTIONS) as llm:
        assert llm.engine.pooler is not None and llm.engine.pooler.pooling_type == "MEAN"
        outputs = llm.embed(batch, use_tqdm=False)
    for prompt, output in zip(batch, outputs, strict=True):
        expected = hf_pooled(hf.model, prompt, "MEAN")
        np.testing.assert_allclose(output.outputs.data, expected, atol=2e-5)
