"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) through the whole engine against
transformers in float32, and the loading of their experts from per-expert checkpoint keys."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from aioinfer import LLM
from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.loader import checkpoint_keys, resolve_model
from aioinfer.model.loader.gguf_loader import iter_gguf
from aioinfer.model.registry import get_model_class
from tests.model.loader.test_loader import write_gguf
from tests.offline.test_llm_vs_hf import GREEDY, hf_greedy, make_prompts
from tests.support.tiny_models import make_hf_model, make_variant
from tests.support.tokenizers import make_tokenizer

OPTIONS = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128}


def save(hf: torch.nn.Module, path: Path) -> Path:
    hf.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(
    scope="module",
    params=["qwen3-moe", "qwen3-moe-top1", "qwen2-moe", "qwen2-moe-step2", "mixtral"],
)
def moe_dir(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    hf = make_variant(request.param)
    return save(hf, tmp_path_factory.mktemp(request.param)), hf


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_equals_transformers(moe_dir, backend):
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    path, hf = moe_dir
    prompts = make_prompts(0, hf.config.vocab_size)
    with LLM(str(path), attention_backend=backend, cpu_kernels=backend, **OPTIONS) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


def test_chunked_prefill_and_preemption(moe_dir):
    path, hf = moe_dir
    prompts = make_prompts(3, hf.config.vocab_size, lengths=(20, 30, 40, 50, 25, 35))
    with LLM(str(path), max_num_batched_tokens=16, num_gpu_blocks_override=10, **OPTIONS) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


def test_checkpoints_store_one_tensor_per_expert(moe_dir):
    """What transformers saves (per-expert keys, Mixtral's under block_sparse_moe) is what the
    loader reads: the keys it asks for are exactly the file's."""
    path, hf = moe_dir
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as f:
        saved = set(f.keys())
    assert checkpoint_keys(hf.config) == saved
    assert any(".experts.3." in key for key in saved)


def test_the_in_memory_layout_loads_too(tmp_path):
    """A checkpoint whose experts are already stacked (transformers' names in memory) loads by
    name, without the per-expert slots."""
    hf = make_variant("qwen3-moe")
    save(hf, tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "model.safetensors").unlink()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompts = make_prompts(5, hf.config.vocab_size, lengths=(9, 17))
    with LLM(str(tmp_path), **OPTIONS) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


def _resave_without(path: Path, drop: str) -> None:
    state = load_file(path / "model.safetensors")
    del state[drop]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_expert_is_named(tmp_path):
    save(make_variant("mixtral"), tmp_path)
    _resave_without(tmp_path, "model.layers.1.block_sparse_moe.experts.2.w3.weight")
    with pytest.raises(ValueError, match=r"lacks 1 weight.*experts\.2\.w3\.weight"):
        LLM(str(tmp_path), **OPTIONS)


def test_an_expert_of_the_wrong_shape_is_named(tmp_path):
    hf = make_variant("qwen3-moe")
    save(hf, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.mlp.experts.5.down_proj.weight"
    state[key] = state[key][:, :-1].contiguous()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.5\.down_proj\.weight has shape"):
        LLM(str(tmp_path), **OPTIONS)


def test_sparse_and_dense_layers_follow_the_config():
    """Qwen3-MoE's `mlp_only_layers` keep the dense MLP; Mixtral has experts everywhere."""
    qwen = get_model_class(make_variant("qwen3-moe").config)
    cfg = qwen.decoder_config(make_variant("qwen3-moe").config)
    assert cfg.sparse_layers == (0,)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.renormalize_routing) == (8, 2, True)
    mixtral = make_variant("mixtral").config
    cfg = get_model_class(mixtral).decoder_config(mixtral)
    assert cfg.sparse_layers == (0, 1)
    assert cfg.expert_intermediate_size == mixtral.intermediate_size


def test_the_bundled_qwen3_30b_a3b_has_the_real_shapes():
    """The config `--load-format dummy` benchmarks with: our model's parameters are
    transformers' in name and shape, and the checkpoint keys are one per expert and projection."""
    from tests.support.tiny_models import bundled_model_and_reference

    config, _, _ = bundled_model_and_reference("Qwen/Qwen3-30B-A3B")
    keys = checkpoint_keys(config)
    assert sum(".experts." in key for key in keys) == 48 * 128 * 3
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in keys


def test_sparse_step_and_biases_of_qwen2_moe():
    config = make_variant("qwen2-moe-step2").config
    cfg = get_model_class(config).decoder_config(config)
    assert cfg.sparse_layers == (1,)  # every second layer: the first stays dense
    assert not cfg.qkv_bias and cfg.renormalize_routing


def test_embeddings_of_a_mixture_of_experts(tmp_path):
    """`--runner pooling` runs the experts too: the last token's final hidden state equals
    transformers'."""
    hf = make_variant("qwen3-moe")
    save(hf, tmp_path)
    prompts = make_prompts(6, hf.config.vocab_size, lengths=(5, 23))
    pooler = '{"pooling_type": "LAST", "normalize": false}'
    with LLM(str(tmp_path), runner="pooling", pooler_config=pooler, **OPTIONS) as llm:
        outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        expected = states[-1][0, -1].numpy()
        assert abs(output.outputs.data - expected).max() < 1e-4


# -- GGUF files, as llama.cpp writes mixtures of experts ----------------------------------------


def stacked_experts(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A saved checkpoint's weights with each layer's experts stacked per projection, under the
    name without the expert ("model.layers.0.mlp.experts.gate_proj.weight"), as llama.cpp's
    converter stacks them."""
    experts: dict[str, dict[int, torch.Tensor]] = {}
    state = {}
    for key, tensor in load_file(checkpoint / "model.safetensors").items():
        expert = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+\.weight)", key)
        if expert is None:
            state[key] = tensor
        else:
            experts.setdefault(f"{expert[1]}.{expert[3]}", {})[int(expert[2])] = tensor
    for key, by_index in experts.items():
        state[key] = torch.stack([by_index[i] for i in range(len(by_index))])
    return state


def _expert_keys(hf: torch.nn.Module, widths: bool = True) -> Callable[[Any], None]:
    """The experts' metadata llama.cpp's converter writes (early qwen2moe files: no widths)."""
    cfg = hf.config

    def add(writer: Any) -> None:
        writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if widths and hasattr(cfg, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if widths and getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    return add


# (GGUF architecture, the HF model, whether the file gives the experts' widths). llama.cpp
# writes Mixtral as "llama"; its MoE layers are all sparse; it renormalizes the chosen experts'
# weights for qwen3moe and Mixtral, not for qwen2moe, whatever a file says.
GGUF_MOES = {
    "mixtral": ("llama", lambda: make_variant("mixtral"), True),
    "qwen2-moe": ("qwen2moe", lambda: make_variant("qwen2-moe"), True),
    # Without the keys of the experts' widths, and without q/k/v biases.
    "qwen2-moe-early": ("qwen2moe", lambda: make_hf_model("qwen2_moe", qkv_bias=False), False),
    "qwen3-moe": ("qwen3moe", lambda: make_hf_model("qwen3_moe", mlp_only_layers=[]), True),
    "qwen3-moe-top1": (
        "qwen3moe",
        lambda: make_hf_model(
            "qwen3_moe", num_experts=16, num_experts_per_tok=1, mlp_only_layers=[]
        ),
        True,
    ),
}


@pytest.mark.parametrize("name", sorted(GGUF_MOES))
def test_a_mixture_of_experts_gguf_equals_transformers(name, tmp_path):
    arch, make, widths = GGUF_MOES[name]
    hf = make()
    save(hf, tmp_path / "hf")
    path = write_gguf(
        hf,
        tmp_path / f"Tiny-{name}-F32.gguf",
        arch,
        extra=_expert_keys(hf, widths),
        state=stacked_experts(tmp_path / "hf"),
    )
    prompts = make_prompts(7, hf.config.vocab_size, lengths=(11, 23))
    config = resolve_model(str(path), gguf_cache=False).hf_config
    assert config.architectures == hf.config.architectures
    with LLM(str(path), tokenizer=str(tmp_path / "hf"), **OPTIONS) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


def test_quantized_stacked_experts_load_expert_by_expert(tmp_path, monkeypatch):
    """Q8_0 experts, read straight from the file (no cache): each expert's weight is its slice
    of the stacked tensor, dequantized; the shared expert's gate, a vector in the file, is
    transformers' [1, hidden]."""
    import gguf
    from gguf.quants import dequantize

    from aioinfer.model.loader import load_model

    monkeypatch.setenv("AIOINFER_GGUF_CACHE", "0")
    hf = make_variant("qwen2-moe")
    save(hf, tmp_path / "hf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = write_gguf(
        hf,
        tmp_path / "Tiny-Q8_0.gguf",
        "qwen2moe",
        qtype=lambda name: q8 if ".experts." in name and "down" not in name else None,
        extra=_expert_keys(hf),
        state=stacked_experts(tmp_path / "hf"),
    )
    resolved = resolve_model(str(path))
    assert resolved.kind == "gguf"
    stacked = next(t for t in resolved.gguf_reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    assert stacked.tensor_type == q8
    expected = torch.from_numpy(dequantize(stacked.data, q8).copy())
    keys = checkpoint_keys(hf.config)
    loaded = dict(iter_gguf(resolved.gguf_reader, resolved.hf_config, keys))
    assert set(loaded) == keys
    for e in range(hf.config.num_experts):
        assert torch.equal(loaded[f"model.layers.1.mlp.experts.{e}.up_proj.weight"], expected[e])
    gate = loaded["model.layers.0.mlp.shared_expert_gate.weight"]
    assert torch.equal(gate, hf.model.layers[0].mlp.shared_expert_gate.weight.detach())
    model = load_model(resolved, torch.float32, torch.device("cpu"))
    assert model is not None


def test_a_gguf_whose_experts_are_not_stacked_as_the_config_says_is_refused(tmp_path):
    """A stacked tensor with fewer experts than the file's expert count names itself."""
    hf = make_variant("mixtral")
    save(hf, tmp_path / "hf")
    state = stacked_experts(tmp_path / "hf")
    key = "model.layers.1.block_sparse_moe.experts.w2.weight"
    state[key] = state[key][:-1]
    path = write_gguf(hf, tmp_path / "bad.gguf", "llama", extra=_expert_keys(hf), state=state)
    resolved = resolve_model(str(path), gguf_cache=False)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down_exps\.weight has shape \(3, "):
        list(iter_gguf(resolved.gguf_reader, resolved.hf_config, checkpoint_keys(hf.config)))
