"""`aioinfer bench throughput` on a tiny random model, against transformers in the same run:
token counts, the JSON file, and our engine's memory freed before the peer runs."""

from __future__ import annotations

import json

import pytest

from aioinfer.bench import throughput
from tests.model.tiny_models import make_variant
from tests.tokenizer_fixtures import make_tokenizer

OPTIONS = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128}


def test_throughput_bench_against_transformers(tmp_path):
    make_variant("qwen2").save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    result_file = tmp_path / "throughput.json"

    ours, peer = throughput.main(
        str(tmp_path / "model"), num_prompts=5, input_len="3:20", output_len="2:9",
        vs="transformers", hf_batch_size=2, seed=1, result_file=str(result_file),
        options=OPTIONS,
    )  # fmt: skip

    workload = throughput.make_workload(5, (3, 20), (2, 9), 512, seed=1)
    assert [r.engine for r in (ours, peer)] == ["aioinfer", "transformers"]
    for result in (ours, peer):
        assert result.num_prompts == 5
        assert result.input_tokens == sum(len(p) for p, _ in workload)
        assert result.output_tokens == sum(n for _, n in workload)
        assert result.seconds > 0
    saved = json.loads(result_file.read_text())
    assert [r["engine"] for r in saved] == ["aioinfer", "transformers"]
    assert saved[0]["output_tokens_per_s"] == pytest.approx(ours.output_tokens_per_s)


def test_throughput_bench_refuses_an_unknown_peer(tmp_path):
    with pytest.raises(ValueError, match="--vs"):
        throughput.main("", 1, "4", "4", "vllm", 1, 0, None, OPTIONS)
