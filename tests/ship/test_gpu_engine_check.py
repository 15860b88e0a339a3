"""scripts/gpu_engine_check.py on the CPU, on a tiny model: the script a GPU run depends on
must not fail on its own bugs (a GPU is lent rarely, for minutes)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_engine_check.py"


def test_the_engine_check_runs_its_worst_case_steps(tmp_path, monkeypatch, capsys):
    make_variant("qwen2").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tmp_path), "float32"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert "KV cache: " in out and "max_num_seqs 16, token budget 512" in out
    assert "CUDA graphs: off (CUDA graphs need a CUDA device)" in out
    assert "generate: 256 tokens, 0 CUDA graph replays" in out
    assert "worst case: prefill 512 tokens over 16 requests" in out
    assert "16 sampled" in out and "OUT OF MEMORY" not in out
    assert out.rstrip().endswith("engine check: ok")
