"""GGUF files beyond the plain case: what llama.cpp writes besides the weights (RoPE scaling,
biases, end-of-turn ids), files that cannot be served (truncated, split, unknown tensors or
types), and the cache when its disk or the tokenizer lets it down. Outputs are checked against
the transformers model each file was written from."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from aioinfer import LLM, SamplingParams, TokensPrompt
from aioinfer.engine.tokenizer import load_tokenizer
from aioinfer.model.loader import gguf_cache, resolve_model
from aioinfer.model.loader.gguf_cache import GGUFFingerprint
from tests.model.loader.test_gguf_cache import cache  # noqa: F401  (autouse: a cache per test)
from tests.model.loader.test_loader import write_gguf
from tests.offline.test_llm_vs_hf import hf_greedy
from tests.support.tiny_models import make_hf_model, make_variant
from tests.support.tokenizers import make_tokenizer

PROMPT = [5, 17, 3, 44, 9, 30, 3, 61, 12, 7]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer().save_pretrained(path)
    return path


def greedy(path: Path, tokenizer_dir: Path) -> list[int]:
    options = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), tokenizer=str(tokenizer_dir), **options) as llm:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


# -- what llama.cpp writes besides the weights ------------------------------------------------


def _rope_keys(**keys: Any) -> Any:
    def add(writer: gguf.GGUFWriter) -> None:
        for key, value in keys.items():
            name = f"llama.rope.scaling.{key}"
            if isinstance(value, str):
                writer.add_string(name, value)
            elif isinstance(value, float):
                writer.add_float32(name, value)
            else:
                writer.add_uint32(name, value)

    return add


def _llama3_rope_freqs(hf: Any) -> Any:
    """rope_freqs as llama.cpp's converter derives it: the default frequencies over Llama 3's
    (here from transformers' own llama3 rope)."""
    cfg = hf.config
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    dim = cfg.head_dim
    default = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))

    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_uint32("llama.rope.scaling.original_context_length", 64)
        writer.add_tensor("rope_freqs.weight", (default / scaled).numpy())

    return add


@pytest.mark.parametrize(
    ("scaling", "extra"),
    [
        ({"rope_type": "linear", "factor": 4.0}, _rope_keys(type="linear", factor=4.0)),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            _rope_keys(type="yarn", factor=4.0, original_context_length=32),
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            None,
        ),
    ],
)
def test_rope_scaling_in_the_file_is_applied(
    tmp_path: Path, tokenizer_dir: Path, scaling: dict[str, Any], extra: Any
) -> None:
    hf = make_hf_model("llama", rope_scaling=scaling)
    plain = make_hf_model("llama")  # the same weights without the scaling
    extra = extra or _llama3_rope_freqs(hf)
    path = write_gguf(
        hf, tmp_path / f"Scaled-{scaling['rope_type']}-F32.gguf", "llama", extra=extra
    )

    resolved = resolve_model(str(path))
    assert resolved.kind == "folder"  # through the cache: the entry's config keeps it
    params = resolved.hf_config.rope_parameters
    assert {k: params[k] for k in scaling} == scaling
    ours = greedy(path, tokenizer_dir)
    assert ours == hf_greedy(hf, PROMPT)
    assert ours != hf_greedy(plain, PROMPT)  # the scaling matters here


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 and 3.3; Llama 3.2
def test_the_rope_freqs_of_a_real_llama_3_shape_are_recognised(
    tmp_path: Path, factor: float
) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    default = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    path = tmp_path / "Llama-3-shape.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(4096)
    writer.add_head_count(32)
    writer.add_block_count(1)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(128)
    writer.add_vocab_size(16)
    writer.add_tensor("rope_freqs.weight", (default / scaled).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = resolve_model(str(path), gguf_cache=False).hf_config.rope_parameters
    assert {k: params[k] for k in scaling} == scaling


def test_a_rope_freqs_tensor_no_llama3_scaling_gives_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hf = make_variant("llama")
    odd = np.linspace(1.0, 3.0, hf.config.head_dim // 2, dtype=np.float32)
    path = write_gguf(
        hf, tmp_path / "Odd.gguf", "llama", extra=lambda w: w.add_tensor("rope_freqs.weight", odd)
    )
    with caplog.at_level(logging.WARNING):
        resolved = resolve_model(str(path), gguf_cache=False)
    assert resolved.hf_config.rope_parameters["rope_type"] == "default"
    assert "rope_freqs" in caplog.text


def test_llama_biases_in_the_file_are_loaded(tmp_path: Path, tokenizer_dir: Path) -> None:
    hf = make_hf_model("llama", attention_bias=True, mlp_bias=True)
    path = write_gguf(hf, tmp_path / "Biased-F32.gguf", "llama")
    config = resolve_model(str(path), gguf_cache=False).hf_config
    assert config.attention_bias and config.mlp_bias
    assert greedy(path, tokenizer_dir) == hf_greedy(hf, PROMPT)


def test_end_of_turn_and_message_ids_stop_as_eos_does(tmp_path: Path) -> None:
    def stops(writer: gguf.GGUFWriter) -> None:
        writer.add_uint32("tokenizer.ggml.eot_token_id", 7)
        writer.add_uint32("tokenizer.ggml.eom_token_id", 2)  # the EOS itself: once

    path = write_gguf(make_variant("llama"), tmp_path / "Turns.gguf", "llama", extra=stops)
    assert resolve_model(str(path)).hf_config.eos_token_id == [2, 7]


# -- files that cannot be served --------------------------------------------------------------


def _tiny(tmp_path: Path, extra: Any = None, name: str = "Tiny.gguf") -> Path:
    return write_gguf(make_variant("llama"), tmp_path / name, "llama", extra=extra)


def test_a_truncated_file_names_itself(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    for size in (100, os.path.getsize(path) // 2):
        cut = tmp_path / f"Cut-{size}.gguf"
        cut.write_bytes(path.read_bytes()[:size])
        with pytest.raises(ValueError, match=r"Cut-\d+\.gguf is not a readable GGUF file"):
            resolve_model(str(cut))


def test_one_part_of_a_split_file_says_to_merge(tmp_path: Path) -> None:
    path = _tiny(tmp_path, lambda w: w.add_uint16("split.count", 2), "Tiny-00001-of-00002.gguf")
    with pytest.raises(ValueError, match=r"split into 2 files.*llama-gguf-split --merge"):
        resolve_model(str(path))


def test_tensors_the_model_has_no_place_for_are_refused_by_name(tmp_path: Path) -> None:
    extra = np.ones(64, dtype=np.float32)
    path = _tiny(tmp_path, lambda w: w.add_tensor("blk.0.attn_q_norm.weight", extra))
    with pytest.raises(ValueError, match=r"no place for: blk\.0\.attn_q_norm\.weight"):
        resolve_model(str(path))
    entries = Path(os.environ["AIOINFER_CACHE"]) / "gguf"
    assert not entries.exists() or all(p.name.startswith(".") for p in entries.iterdir())


def test_a_tensor_type_that_cannot_be_dequantized_is_named_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = make_variant("llama")
    state = hf.state_dict()
    norm = state["model.norm.weight"].double()
    monkeypatch.setitem(state, "model.norm.weight", norm)  # written as F64
    monkeypatch.setattr(hf, "state_dict", lambda: state)
    path = write_gguf(hf, tmp_path / "F64.gguf", "llama")
    with pytest.raises(ValueError, match=r"output_norm\.weight is of type F64"):
        resolve_model(str(path))


# -- the cache when the disk or the tokenizer lets it down ------------------------------------


def test_a_full_disk_loads_the_gguf_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _tiny(tmp_path)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    assert resolve_model(str(path)).kind == "gguf"
    monkeypatch.undo()

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    assert resolve_model(str(path)).kind == "gguf"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_cached_gguf_without_a_usable_vocabulary_fails_as_without_the_cache(
    tmp_path: Path, tokenizer_dir: Path, arch: str
) -> None:
    """No vocabulary, or one transformers cannot rebuild: the entry is written without a
    tokenizer, and the tokenizer then fails as it does from the file, never a placeholder."""
    hf = make_variant(arch)
    files = [write_gguf(hf, tmp_path / f"NoVocab-{arch}.gguf", arch)]

    def bert_vocab(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("bert")
        writer.add_token_list([f"t{i}" for i in range(hf.config.vocab_size)])

    files.append(write_gguf(hf, tmp_path / f"Bert-{arch}.gguf", arch, extra=bert_vocab))
    for path in files:
        with pytest.raises(Exception) as direct:
            load_tokenizer(resolve_model(str(path), gguf_cache=False))
        cached = resolve_model(str(path))
        assert cached.kind == "folder" and not (cached.folder / "tokenizer.json").exists()
        with pytest.raises(type(direct.value)):
            load_tokenizer(cached)
        assert load_tokenizer(cached, tokenizer=str(tokenizer_dir)).vocab_size > 0


def test_a_change_at_the_end_of_a_file_with_its_mtime_kept_is_a_new_entry(
    tmp_path: Path,
) -> None:
    hf = make_hf_model("llama", vocab_size=8192)  # 4 MiB: its ends are not its middle
    path = write_gguf(hf, tmp_path / "Big.gguf", "llama")
    before = GGUFFingerprint.of(path)
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(4 - b % 4 for b in data[-4:])  # the last weight's last bytes
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = GGUFFingerprint.of(path)
    assert (after.size, after.mtime_ns, after.header_sha256) == (
        before.size,
        before.mtime_ns,
        before.header_sha256,
    )
    assert after.key != before.key


def test_a_pooling_model_may_leave_the_file_s_head_unused(tmp_path: Path) -> None:
    from aioinfer.model.loader import checkpoint_keys
    from aioinfer.model.loader.gguf_loader import gguf_names

    resolved = resolve_model(str(_tiny(tmp_path)), gguf_cache=False)  # untied: output.weight
    wanted = set(checkpoint_keys(resolved.hf_config)) - {"lm_head.weight"}
    names = gguf_names(resolved.gguf_reader, resolved.hf_config, iter(wanted))
    assert "output.weight" not in names and len(names) == len(wanted)
