"""The byte codes of a GGUF cache entry's linears (codes_cache.py): found at the first start,
kept beside the entry, read back at the next start instead of found again, and found again
when the kept file does not read or does not fit."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.model.cpu import codes_cache, layers, packed_weights
from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.cpu.layers import PackedLinear
from aioinfer.model.cpu.packed_weights import CodedWeight
from tests.model.loader.test_loader import write_gguf
from tests.support.tiny_models import make_hf_model
from tests.support.tokenizers import make_tokenizer

PROMPTS = [[7, 19, 300, 42], [8, 19, 301, 42, 5, 6]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture
def q8_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Q8_0 GGUF of a tiny Llama (its linears decode to exact byte codes), with the cache
    in tmp_path."""
    monkeypatch.setenv("AIOINFER_CACHE", str(tmp_path / "cache"))
    hf = make_hf_model("llama", seed=3, hidden_size=128, intermediate_size=256)
    path = write_gguf(hf, tmp_path / "Q8.gguf", "llama", qtype=gguf.GGMLQuantizationType.Q8_0)
    make_tokenizer().save_pretrained(tmp_path / "tok")
    return path


def run(path: Path) -> tuple[list[object], int, Path]:
    """One start on `path`: its outputs, how many linears hold codes, and its cache entry."""
    with LLM(
        str(path), tokenizer=str(path.parent / "tok"), dtype="float32", kv_cache_memory=0.01,
        max_model_len=64, cpu_weight_format="auto", cpu_amx=False,
    ) as llm:  # fmt: skip
        runner = llm.engine.gpu.runner
        coded = sum(
            1 for m in runner.model.modules() if isinstance(m, PackedLinear) and m.codes is not None
        )
        outputs = [
            (c.token_ids, c.logprobs)
            for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            for c in out.outputs
        ]
    (entry,) = (path.parent / "cache" / "gguf").iterdir()
    return outputs, coded, entry


@pytest.fixture
def native() -> None:
    if cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())


def test_a_second_start_reads_the_codes_instead_of_finding_them(
    q8_gguf: Path, monkeypatch: pytest.MonkeyPatch, native: None
) -> None:
    first, coded, entry = run(q8_gguf)
    assert coded > 0
    kept = codes_cache.codes_file(entry)
    assert kept.is_file()
    assert sum(c is not None for c in codes_cache.read_codes(kept).values()) == coded

    def refuse(*args: object) -> None:
        raise AssertionError("codes found again at a warm start")

    monkeypatch.setattr(layers, "code_weight", refuse)
    second, coded_again, _ = run(q8_gguf)
    assert coded_again == coded
    assert second == first


def test_a_damaged_or_misfit_file_is_found_again(
    q8_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, native: None
) -> None:
    first, coded, entry = run(q8_gguf)
    kept = codes_cache.codes_file(entry)
    kept.write_bytes(b"not safetensors")
    found = []
    real = packed_weights.code_weight

    def counting(*args: object) -> CodedWeight | None:
        found.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(layers, "code_weight", counting)
    assert run(q8_gguf)[0] == first
    assert len(found) >= coded
    assert "Ignoring the kept byte codes" in caplog.text
    assert codes_cache.read_codes(kept)  # written again, whole

    # Codes of another shape under a linear's name are not taken.
    known = codes_cache.read_codes(kept)
    name = next(n for n, c in known.items() if c is not None)
    wrong = known[name]
    assert wrong is not None
    known[name] = CodedWeight(wrong.codes[:1].clone(), wrong.scales[:1].clone())
    codes_cache.write_codes(kept, known)
    found.clear()
    assert run(q8_gguf)[0] == first
    assert len(found) == 1


def test_a_changed_coder_writes_a_new_file(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    entry.mkdir()
    old = entry / "cpu-codes-0000000000000000.bin"
    old.write_bytes(b"x")
    codes = CodedWeight(torch.zeros(1, 32, 16, dtype=torch.int8), torch.ones(1, 1, 2, 16))
    kept = codes_cache.codes_file(entry)
    codes_cache.write_codes(kept, {"a": codes, "b": None})
    assert not old.exists()
    read = codes_cache.read_codes(kept)
    assert read["b"] is None and read["a"] is not None
    assert torch.equal(read["a"].codes, codes.codes)
