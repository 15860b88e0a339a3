"""`aioinfer bench latency` on a tiny random model: the result's structure, positive and
consistent timings, and the weight bytes of the floor against the transformers model."""

from __future__ import annotations

import json

import pytest
import torch

from aioinfer.bench import latency
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

OPTIONS = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128}


def hf_decode_bytes(hf: torch.nn.Module) -> int:
    """Every distinct parameter once; an untied input embedding only for one row."""
    embed = hf.get_input_embeddings().weight
    tied = hf.get_output_embeddings().weight is embed
    total = sum(p.numel() * p.element_size() for p in hf.parameters())  # deduplicates ties
    if not tied:
        total -= (embed.numel() - embed.shape[1]) * embed.element_size()
    return total


@pytest.mark.parametrize("variant", ["llama", "llama-tied"])
def test_weight_bytes_counts_what_a_decode_step_reads(variant):
    hf = make_variant(variant)
    assert latency.weight_bytes(hf) == hf_decode_bytes(hf)


@pytest.mark.parametrize("amx", [False, True], ids=["codes and strips", "codes and parts"])
def test_weight_bytes_of_a_coded_linear_are_its_codes(amx: bool) -> None:
    """Batch-1 steps read a coded linear's codes and scales, not the float32 strips or the
    weight parts that steps of many rows read."""
    from aioinfer.model.cpu import kernels as cpu_native
    from aioinfer.model.cpu.layers import PackedLinear
    from tests.model.cpu.test_coded_weights import ggml_round_trip

    kernels = cpu_native.load()
    if kernels is None or (amx and not kernels.has_amx):
        pytest.skip("needs the native kernels" + (" with AMX" if amx else ""))
    linear = torch.nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight.copy_(ggml_round_trip(linear.weight, "Q4_1"))
    packed = PackedLinear(linear, kernels, code="auto", amx=amx)
    other = packed.parts if amx else packed.packed
    assert packed.codes is not None and packed.scales is not None and other is not None
    read = packed.codes.nbytes + packed.scales.nbytes + linear.bias.nbytes
    assert latency.weight_bytes(packed) == read


def test_latency_bench_on_a_tiny_model(tmp_path):
    hf = make_variant("llama")
    hf.save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    result_file = tmp_path / "latency.json"

    result = latency.main(
        str(tmp_path / "model"),
        input_len=16,
        output_len=4,
        num_iters=2,
        num_iters_warmup=1,
        prompt=None,
        seed=0,
        result_file=str(result_file),
        options=OPTIONS,
        bandwidth_mib=16,
        bandwidth_reps=3,
    )

    assert (result.input_len, result.output_len) == (16, 4)
    assert len(result.ttft_s) == len(result.e2e_s) == 2
    assert all(t > 0 for t in result.ttft_s + result.e2e_s)
    assert 0 < result.ttft_median_s < result.e2e_median_s
    assert 0 < result.tpot_s < result.e2e_median_s
    # The runner's weights are the transformers model's, so the bytes must agree exactly.
    assert result.weight_bytes == hf_decode_bytes(hf)
    assert result.bandwidth_bytes_per_s > 0
    assert result.floor_tpot_s == pytest.approx(result.weight_bytes / result.bandwidth_bytes_per_s)
    assert result.device == "cpu" and result.dtype == "torch.float32"

    saved = json.loads(result_file.read_text())
    assert saved["tpot_s"] == pytest.approx(result.tpot_s)
    assert saved["ttft_s"] == result.ttft_s
    assert saved["decode_tokens_per_s"] == pytest.approx(1 / result.tpot_s)


def test_latency_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match="output_len"):
        latency.main("", 16, 1, 3, 1, None, 0, None, OPTIONS)
    with pytest.raises(ValueError, match="num_iters"):
        latency.main("", 16, 8, 0, 1, None, 0, None, OPTIONS)
