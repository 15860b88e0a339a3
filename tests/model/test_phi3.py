"""Phi-3 and Phi-4 (fused qkv_proj and gate_up_proj checkpoints, LongRoPE) through the whole
engine against transformers in float32."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from aioinfer import LLM
from aioinfer.gpu.cuda_graphs import CudaGraphRunner
from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.forward_context import forward_context
from aioinfer.model.layers.attention import AttentionMetadata
from aioinfer.model.layers.rotary import attention_factor, compute_inv_freq, rope_config_from_hf
from aioinfer.model.loader import checkpoint_keys
from tests.offline.test_llm_vs_hf import GREEDY, hf_greedy, make_prompts
from tests.support.tiny_models import BASE_CONFIG, _randomize
from tests.support.tokenizers import make_tokenizer

OPTIONS = {"dtype": "float32", "kv_cache_memory": 0.01}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [2.0] * 8,
}


def make_phi3(**overrides) -> torch.nn.Module:
    settings = {**BASE_CONFIG, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}
    config = Phi3Config(**{**settings, **overrides}, attn_implementation="eager")
    config.architectures = ["Phi3ForCausalLM"]
    torch.manual_seed(0)
    hf = Phi3ForCausalLM(config).float().eval()
    _randomize(hf, 0)
    return hf


# Of the prompts below (1 to 50 tokens, 12 new tokens each), those of 1-7 tokens stay within a
# 24-token original context, those of 16 and 17 grow past it while decoding, and those of 33 and
# 50 start past it.
ORIGINAL = 24


def saved_phi3(tmp_path_factory, rope: str) -> tuple[Path, torch.nn.Module]:
    overrides = {}
    if rope == "longrope":
        overrides = {"rope_scaling": LONGROPE, "original_max_position_embeddings": ORIGINAL}
    hf = make_phi3(**overrides)
    path = tmp_path_factory.mktemp(f"phi3-{rope}")
    hf.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module", params=["default", "longrope"])
def phi3(request, tmp_path_factory):
    return saved_phi3(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    return saved_phi3(tmp_path_factory, "longrope")


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_equals_transformers(phi3, backend):
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    path, hf = phi3
    prompts = make_prompts(0, 512, lengths=(1, 3, 7, 16, 17, 33, 50))
    options = {**OPTIONS, "attention_backend": backend, "cpu_kernels": backend}
    with LLM(str(path), max_num_batched_tokens=16, **options) as llm:
        assert llm.engine.max_model_len == 256
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


@torch.no_grad()
def test_longrope_past_the_original_context_equals_transformers_generate(phi3_longrope):
    """transformers' own generate (with its cache, which Phi-3 drops once a sequence grows
    past the original context) gives what the engine gives; a prompt that is the first
    request's whole text then starts past the original context and reuses the K/V the engine
    computed again with the long factors, while the first prompt reuses the short ones."""
    path, hf = phi3_longrope
    prompt = make_prompts(3, 512, lengths=(17,))[0]  # 17 + 12 tokens: past 24 while decoding
    generated = hf.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
    )[0, len(prompt) :].tolist()
    assert generated == hf_greedy(hf, prompt)
    with LLM(str(path), max_num_batched_tokens=16, **OPTIONS) as llm:
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert first == generated
        whole = prompt + first  # 29 tokens: its first 16-token block is cached, long
        again = llm.generate([whole, prompt], GREEDY, use_tqdm=False)
        assert [o.num_cached_tokens for o in again] == [16, 16]
    assert [o.outputs[0].token_ids for o in again] == [hf_greedy(hf, whole), generated]


def test_longrope_on_the_native_decoder_stack(tmp_path):
    """The native kernels' whole-layer path (head_dim 32, which it takes) rotates each
    request's tokens with the factors its length calls for."""
    if cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    factors = {"short_factor": [1.0 + 0.2 * i for i in range(16)], "long_factor": [3.0] * 16}
    hf = make_phi3(
        rope_scaling={**LONGROPE, **factors},
        original_max_position_embeddings=ORIGINAL,
        hidden_size=128,
        intermediate_size=256,
    )
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = make_prompts(5, 512, lengths=(7, 17, 24, 25, 40))
    options = {**OPTIONS, "attention_backend": "native", "cpu_kernels": "native"}
    with LLM(str(tmp_path), max_num_batched_tokens=16, **options) as llm:
        assert type(llm.engine.gpu.runner.model.model).__name__ == "NativeLlamaModel"
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


class RotaryGraph:
    """Stands in for a captured CUDA graph on the CPU: replay() computes the rotary cos and
    sin that the graph's forward pass would, from the runner's static buffers. (The whole
    forward pass would need a graph-safe attention backend, which the CPU has not.)"""

    def __init__(self, graphs: CudaGraphRunner, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        graphs, bs = self.graphs, self.bs
        with forward_context(graphs._metadata(bs), graphs.kv_caches):
            cos, _ = graphs.model.model.rotary_cos_sin(graphs.positions[:bs], torch.float32)
        graphs.outputs[bs].copy_(cos)


@torch.inference_mode()
def test_longrope_rows_reach_the_cuda_graphs_static_buffers(phi3_longrope):
    """replay() copies the step's long rows into the graphs' buffer and clears it for a step
    with none: the graph's rotary equals the eager one's either way."""
    path, hf = phi3_longrope
    with LLM(str(path), **OPTIONS) as llm:
        runner = llm.engine.gpu.runner
        graphs = CudaGraphRunner(
            runner.model, runner.kv_caches, None, 4, 8, 128, runner.device, long_rope=True
        )
        head_dim = hf.config.hidden_size // hf.config.num_attention_heads
        graphs.outputs[2] = torch.empty(2, head_dim // 2)
        graphs.graphs[2] = RotaryGraph(graphs, 2)  # type: ignore[assignment]
        rotary = runner.model.model.rotary_cos_sin
        for long_rows in (torch.tensor([False, True]), torch.tensor([True, True]), None):
            metadata = AttentionMetadata.build([1, 1], [20, 40], [[1, 2], [3, 4, 5]], 16)
            metadata = replace(metadata, long_rope_rows=long_rows)
            with forward_context(metadata, runner.kv_caches):
                eager, _ = rotary(metadata.positions, torch.float32)
            replayed = graphs.replay(torch.tensor([7, 9]), metadata.positions, metadata)
            torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


def test_the_checkpoint_keys_are_the_fused_ones(phi3):
    path, hf = phi3
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert checkpoint_keys(hf.config) == set(f.keys())


def test_longrope_frequencies_and_factor_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = make_phi3(rope_scaling=LONGROPE, original_max_position_embeddings=64)
    rope = rope_config_from_hf(hf.config)
    expected, factor = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu")
    torch.testing.assert_close(compute_inv_freq(16, rope), expected, atol=0, rtol=1e-6)
    assert attention_factor(rope) == pytest.approx(factor) and factor > 1


@pytest.mark.parametrize(
    ("rope", "sizes"),
    [
        ({"rope_type": "default", "partial_rotary_factor": 0.75}, {}),  # 12 of 16 dims
        # Phi-4-mini's shape: LongRoPE factors for the rotated dims only.
        ({**LONGROPE, "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [2.0] * 4,
          "partial_rotary_factor": 0.5}, {"original_max_position_embeddings": 64}),
        # 32 of 64 dims: the native rotary kernel, on a strided view.
        ({"rope_type": "default", "partial_rotary_factor": 0.5},
         {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}),
    ],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_partial_rotary_equals_transformers(tmp_path, rope, sizes, backend):
    """Phi-4-mini rotates the first partial_rotary_factor of each head's dims."""
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    hf = make_phi3(rope_scaling=rope, **sizes)
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = make_prompts(4, 512, lengths=(1, 9, 30))
    options = {**OPTIONS, "attention_backend": backend, "cpu_kernels": backend}
    with LLM(str(tmp_path), max_num_batched_tokens=16, **options) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


def test_a_phi3_sliding_window_applies_past_it(tmp_path):
    """Phi-3-mini-4k's window (2047 of 4096 positions), as transformers applies it: prompts
    and outputs past an 8-token window are equal."""
    hf = make_phi3(sliding_window=8)
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = make_prompts(1, 512, lengths=(4, 12, 30))
    with LLM(str(tmp_path), **OPTIONS) as llm:
        assert llm.engine.max_model_len == hf.config.max_position_embeddings
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]
