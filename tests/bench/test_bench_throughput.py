"""`aioinfer bench throughput` on a tiny random model, against transformers in the same run:
token counts, the JSON file, and our engine's memory freed before the peer runs."""

from __future__ import annotations

import json
import threading

import pytest

from aioinfer.bench import throughput
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

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
    with pytest.raises(ValueError, match="--rounds must be at least 1, got 0"):
        throughput.main("", 1, "4", "4", None, 1, 0, None, OPTIONS, rounds=0)


@pytest.mark.parametrize("vs", [None, "transformers"])
def test_throughput_bench_in_rounds_alternates_the_engines(tmp_path, capsys, monkeypatch, vs):
    """Each round a fresh engine of ours (its prompts not cached from the last round), then
    the peer; the table gives each round's ratio and their median."""
    from aioinfer.offline import llm as llm_module

    make_variant("llama").save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    result_file = tmp_path / "throughput.json"
    engines_built, real_llm = [], llm_module.LLM
    monkeypatch.setattr(
        llm_module, "LLM", lambda *a, **k: engines_built.append(1) or real_llm(*a, **k)
    )
    peer_threads, real_peer = [], throughput.run_transformers
    monkeypatch.setattr(
        throughput,
        "run_transformers",
        lambda *a: peer_threads.append(threading.current_thread()) or real_peer(*a),
    )

    results = throughput.main(
        str(tmp_path / "model"), num_prompts=3, input_len="40", output_len="3", vs=vs,
        hf_batch_size=3, seed=2, result_file=str(result_file), options=OPTIONS, rounds=3,
    )  # fmt: skip

    assert len(engines_built) == 3
    # The peer runs on threads that end, so no OpenMP team of its outlives it (see main).
    assert len(peer_threads) == (3 if vs else 0)
    assert all(t is not threading.main_thread() and not t.is_alive() for t in peer_threads)
    engines = ["aioinfer", "transformers"] if vs else ["aioinfer"]
    assert [r.engine for r in results] == engines * 3
    assert [r.round for r in results] == [n for n in (1, 2, 3) for _ in engines]
    assert all(r.output_tokens == 9 and r.input_tokens == 120 for r in results)
    saved = json.loads(result_file.read_text())
    assert [(r["engine"], r["round"]) for r in saved] == [(r.engine, r.round) for r in results]
    printed = capsys.readouterr().out
    if vs:
        ratios = [a.output_tokens_per_s / b.output_tokens_per_s
                  for a, b in zip(results[::2], results[1::2], strict=True)]  # fmt: skip
        assert "; ".join(f"{x:.2f}x" for x in ratios) in printed
        assert f"(median {sorted(ratios)[1]:.2f}x)" in printed
    else:
        assert "output throughput" not in printed
