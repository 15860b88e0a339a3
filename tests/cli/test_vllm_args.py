"""vLLM's `serve` command lines as users copy them: translated to ours, dropped with a note
where they change nothing, refused in one line where they cannot apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aioinfer.cli.main import _flag_kind, build_configs, serve_help
from aioinfer.cli.vllm_args import human_number_args, translate
from aioinfer.config import ModelConfig, ServerConfig
from tests.cli.test_cli_help import run_cli


def ours(*argv: str) -> list[str]:
    args, _ = translate(list(argv), _flag_kind)
    return args


def test_the_model_flag_is_the_positional_model():
    assert ours("--model", "Qwen/Q", "--port", "8001") == ["Qwen/Q", "--port", "8001"]
    assert ours("--port", "8001", "--model=Qwen/Q") == ["Qwen/Q", "--port", "8001"]
    assert ours("Qwen/Q", "--model", "Qwen/Q") == ["Qwen/Q"]
    with pytest.raises(ValueError, match="given twice"):
        ours("Qwen/Q", "--model", "Other/O")


def test_flags_that_change_nothing_are_dropped_with_a_note():
    args, notes = translate(
        ["M", "--trust-remote-code", "--swap-space", "4", "-tp", "1", "-O3", "-O", "2",
         "--kv-cache-dtype=auto", "--enable-chunked-prefill", "--seed", "3"],
        _flag_kind,
    )  # fmt: skip
    assert args == ["M", "--seed", "3"]
    assert len(notes) == 7 and "no code from a model repository" in notes[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["M", "--tensor-parallel-size", "2"], "--tensor-parallel-size must be 1 here"),
        (["M", "-q", "awq"], "--quantization cannot be set here"),
        (["M", "--skip-tokenizer-init"], "--skip-tokenizer-init cannot be on"),
    ],
)
def test_values_that_cannot_apply_are_refused_in_one_line(argv, message):
    with pytest.raises(ValueError, match=message):
        ours(*argv)


def test_several_values_after_one_flag_repeat_it_and_lengths_read_as_vllm_reads_them():
    assert ours("M", "--api-key", "k1", "k2", "--port", "1") == [
        "M", "--api-key", "k1", "--api-key", "k2", "--port", "1"
    ]  # fmt: skip
    assert ours("M", "--lora-modules", "a=/p", "b=/q") == [
        "M", "--lora-modules", "a=/p", "--lora-modules", "b=/q"
    ]  # fmt: skip
    for value, tokens in (("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("auto", -1), ("-1", -1)):
        assert ours("M", "--max-model-len", value) == ["M", "--max-model-len", str(tokens)]
    assert ours("M", "--enable-log-requests") == ["M", "--log-requests"]
    # An unknown flag keeps its value, so that the parser can name it; one followed by a flag
    # is a switch (it used to take the flag, and the flag's value became a second model).
    assert ours("--max-modle-len", "4096", "M") == ["M", "--max-modle-len", "4096"]
    assert ours("M", "--enable-sleep-mode", "--max-model-len", "4096") == [
        "M", "--enable-sleep-mode", "--max-model-len", "4096"
    ]  # fmt: skip
    # Deployment switches of current vLLM recipes, dropped with a note each, their values too;
    # vLLM's --async-scheduling is ours (on by default).
    args, notes = translate(
        ["M", "--async-scheduling", "--api-server-count", "1", "--disable-frontend-multiprocessing",
         "--max-cudagraph-capture-size", "64", "--long-prefill-token-threshold", "512"],
        _flag_kind,
    )  # fmt: skip
    assert args == ["M", "--async-scheduling"] and len(notes) == 4
    assert "one process" in notes[0]


def test_underscore_spellings_of_flags_read_as_the_dashed_ones():
    """As vLLM's parser, and Helm charts, spell them; values are never rewritten."""
    assert ours("M", "--gpu_memory_utilization", "0.9", "--max_loras=2") == [
        "M", "--gpu-memory-utilization", "0.9", "--max-loras=2"
    ]  # fmt: skip
    assert ours("M", "--api_key", "--my_key", "--served_model_name", "a_b") == [
        "M", "--api-key", "--my_key", "--served-model-name", "a_b"
    ]  # fmt: skip
    assert ours("M", "--no_async_scheduling") == ["M", "--no-async-scheduling"]
    assert human_number_args(["M", "--max_model_len", "4k"], _flag_kind) == [
        "M", "--max-model-len", "4000"
    ]  # fmt: skip


def test_a_config_file_holds_flags_that_the_command_line_overrides(tmp_path: Path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: Qwen/Q\nport: 8001\nenable-prefix-caching: false\napi_key: [k1, k2]\n"
        "override-generation-config: {temperature: 0.5}\ntrust-remote-code: true\n"
    )
    args, notes = translate(["--config", str(config), "--port", "9000"], _flag_kind)
    assert args == [
        "Qwen/Q", "--port", "8001", "--no-enable-prefix-caching", "--api-key", "k1",
        "--api-key", "k2", "--override-generation-config", '{"temperature": 0.5}', "--port", "9000",
    ]  # fmt: skip
    assert notes and "--trust-remote-code" in notes[0]
    # A flag of several values on the command line replaces the file's list.
    for new_key in (["--api-key", "new"], ["--api-key=new"]):
        args, _ = translate(["--config", str(config), *new_key], _flag_kind)
        assert "k1" not in args and "k2" not in args and args[-1].endswith("new")
    with pytest.raises(ValueError, match="--config"):
        ours("--config", str(tmp_path / "missing.yaml"))


def test_vllm_s_key_variable_is_read_when_ours_is_not_set(monkeypatch):
    monkeypatch.delenv("AIOINFER_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    assert build_configs({})[3].api_key == ("vk",)
    monkeypatch.setenv("AIOINFER_API_KEY", "ak")
    assert build_configs({})[3].api_key == ("ak",)
    # --api-key wins over both, as in vLLM; an empty variable is one not set.
    assert build_configs({"api_key": ["flag"]})[3].api_key == ("flag",)
    monkeypatch.setenv("AIOINFER_API_KEY", "")
    assert build_configs({})[3].api_key == ("vk",)
    # An empty flag (`--api-key "$KEY"` with KEY unset) served a key no client could send.
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="--api-key must not be empty"):
            build_configs({"api_key": ["k", empty]})


def test_keys_with_whitespace_around_them_are_refused_and_no_repr_shows_a_key(monkeypatch):
    """A client's key is compared stripped, so a key configured with whitespace around it
    could never match: refused, without showing it. No repr of the config shows a key."""
    monkeypatch.delenv("AIOINFER_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for spaced in (" sk-secret", "sk-secret\n", "sk-secret\t"):
        with pytest.raises(ValueError, match="whitespace") as refused:
            build_configs({"api_key": ["k", spaced]})
        assert "sk-secret" not in str(refused.value)
        with pytest.raises(ValueError, match="key 2 of 2 begins or ends with whitespace"):
            ServerConfig(api_key=("k", spaced))
    with pytest.raises(ValueError, match="key 1 of 1 is empty"):
        ServerConfig(api_key=("",))
    server = build_configs({"api_key": ["sk-secret-1", "sk-secret-2"]})[3]
    assert server.api_key == ("sk-secret-1", "sk-secret-2")
    assert "sk-secret" not in repr(server) and "sk-secret" not in str(server)


def test_repeatable_flags_left_at_their_default_are_tuples_so_not_reported_as_changed():
    _, _, _, server = build_configs({"lora_modules": [], "api_key": []})
    assert server.lora_modules == () and server.api_key == ()


def test_help_finds_flags_by_a_part_of_their_name_and_by_their_negation():
    assert "--enable-prefix-caching / --no-enable-prefix-caching" in serve_help("prefix")
    assert serve_help("no-enable-prefix-caching") == serve_help("enable-prefix-caching")


def test_the_penalties_are_generation_overrides_too():
    config = ModelConfig(override_generation_config='{"presence_penalty": 0.5}')
    assert config.generation_overrides == {"presence_penalty": 0.5}


def test_the_command_refuses_in_one_line_before_loading_anything():
    result = run_cli("serve", "--model", "Qwen/Q", "--tensor-parallel-size", "2")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "Error: --tensor-parallel-size must be 1 here (one model on one device), got 2"
    )
    assert run_cli("-h").returncode == 0
    assert run_cli("serve", "m", "--api-key").returncode == 2  # never a server without its key


def test_several_served_names_are_aliases_of_the_first():
    assert ours("M", "--served-model-name", "a", "b") == [
        "M", "--served-model-name", "a", "--served-model-name", "b"
    ]  # fmt: skip
    model, _, _, _ = build_configs({"served_model_name": ["a", "b"]})
    assert model.served_model_name == ("a", "b")
    assert ModelConfig(served_model_name="one").served_model_name == ("one",)


def test_a_second_value_before_the_model_is_the_model_only_where_it_looks_like_one(tmp_path):
    """`--api-key k1 k2` with no model yet: vLLM reads both as keys; reading k2 as the model
    logged it and sent it to the hub. After a key, only a local path or a GGUF is the model
    (a base64 key may read as owner/name); after the other flags, an owner/name id too.
    Anything else is refused, naming neither value."""
    refused_lines = (
        ("--api-key", "k1", "secret2"),
        ("--api-key", "k1", "q8Zf0/Ms2pLx9Kw1"),
        ("--api-key", "k1", "--api-key", "k2", "org/M"),
        ("--served-model-name", "alpha", "bravo", "--port", "9"),
    )
    for argv in refused_lines:
        with pytest.raises(ValueError, match="only after the model: aioinfer serve MODEL") as no:
            ours(*argv)
        assert not {a for a in argv if not a.startswith("-")} & set(str(no.value).split())
    folder = tmp_path / "model"
    folder.mkdir()
    assert ours("--api-key", "k", str(folder)) == [str(folder), "--api-key", "k"]
    assert ours("--api-key", "k", "small.gguf") == ["small.gguf", "--api-key", "k"]
    assert ours("--served-model-name", "x", "org/M") == ["org/M", "--served-model-name", "x"]
    assert ours("M", "--api-key", "k1", "k2") == ["M", "--api-key", "k1", "--api-key", "k2"]
    assert ours("--model", "M", "--api-key", "k1", "k2") == [
        "M", "--api-key", "k1", "--api-key", "k2"
    ]  # fmt: skip


def test_command_lines_that_worked_before_keep_their_meaning(tmp_path):
    """The model after a flag of several values is still the model where it cannot be a
    secret (a hub id after --api-key is refused: see above); a key may start with "-"; a
    flag left without its value still fails; a model path may look like a flag name."""
    model = str(tmp_path)
    assert ours("--api-key", "k", model) == [model, "--api-key", "k"]
    assert ours("--api-key", "k", model, "--device", "cpu") == [
        model,
        "--api-key",
        "k",
        "--device",
        "cpu",
    ]
    assert ours("--api-key", "k1", "--api-key", "k2", model) == [
        model, "--api-key", "k1", "--api-key", "k2"
    ]  # fmt: skip
    assert ours("--allowed-origins", "*", "org/M") == ["org/M", "--allowed-origins", "*"]
    with pytest.raises(ValueError, match="only after the model"):
        ours("--api-key", "k", "org/M")  # worked before: the model must come first now
    assert ours("M", "--api-key", "-secret") == ["M", "--api-key", "-secret"]
    assert ours("M", "--api-key") == ["M", "--api-key"]  # the parser refuses it
    assert ours("./quantization", "--port", "9") == ["./quantization", "--port", "9"]
    assert ours("M", "--enable-log-requests=false") == ["M"]
    assert ours("M", "--enforce-eager", "--seed", "-1") == ["M", "--enforce-eager", "--seed", "-1"]


def test_config_file_values_of_every_type(tmp_path: Path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: M\nenforce_eager: false\nseed: null\nenable_prefix_caching: false\n"
        "lora_modules: [{name: sql, path: /p}]\n"
    )
    args, _ = translate(["M", "--config", str(config)], _flag_kind)
    assert args == [
        "M", "--no-enable-prefix-caching", "--lora-modules", '{"name": "sql", "path": "/p"}'
    ]  # fmt: skip
    config.write_text("served_model_name: [a, b]\nport: [1, 2]\n")
    with pytest.raises(ValueError, match="port takes one value"):
        ours("--config", str(config))
    with pytest.raises(ValueError, match="more than once"):
        ours("--config", str(config), "--config", str(config))
    with pytest.raises(ValueError, match="needs a YAML file"):
        ours("M", "--config")


def test_lora_modules_without_enable_lora_are_refused_before_anything_loads():
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_configs({"lora_modules": ["a=/p"]})
    model, _, _, server = build_configs({"lora_modules": ["a=/p"], "enable_lora": True})
    assert model.enable_lora and server.lora_modules == ("a=/p",)


def test_plan_reads_the_length_and_the_kv_bytes_as_serve_does():
    assert human_number_args(["M", "--max-model-len", "32k", "--json"], _flag_kind) == [
        "M", "--max-model-len", "32000", "--json"
    ]  # fmt: skip
    assert human_number_args(["--max-model-len=auto", "M"], _flag_kind) == [
        "--max-model-len=-1",
        "M",
    ]
    assert human_number_args(["M", "--max-model-len"], _flag_kind) == ["M", "--max-model-len"]
    assert human_number_args(["M", "--kv-cache-memory-bytes=1G"], _flag_kind) == [
        "M", f"--kv-cache-memory-bytes={2**30}"
    ]  # fmt: skip
    done = run_cli("plan", "--device", "cpu", "--kv-cache-memory-bytes", "1G", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["available_kv_gib"] == 1.0


def test_vllm_s_frontend_flags_of_0_33():
    """Queue bound, CORS, access log and load tracking flags as vLLM 0.33 names them; the
    usage and log flags have the same names here."""
    args, notes = translate(
        ["M", "--max-num-queued-reqs", "64", "--allowed-methods", '["GET"]', "--allowed-headers",
         "*", "--enable-server-load-tracking", "--disable-access-log-for-endpoints", "/health",
         "--max-log-len=100", "--enable-force-include-usage", "--enable-prompt-tokens-details",
         "--chat-template-content-format", "string"],
        _flag_kind,
    )  # fmt: skip
    assert args == ["M", "--max-queued-requests", "64", "--max-log-len=100",
                    "--enable-force-include-usage", "--enable-prompt-tokens-details"]  # fmt: skip
    assert "vLLM's counts the running ones too" in notes[0] and len(notes) == 6
    assert ours("M", "--max-num-queued-reqs=8") == ["M", "--max-queued-requests", "8"]
    assert ours("M", "--kv-cache-memory-bytes", "2G") == ["M", "--kv-cache-memory-bytes",
                                                          str(2 * 2**30)]  # fmt: skip
    for flag in ("--max-queued-requests", "--max-log-len"):
        assert _flag_kind(flag) == "value"
    for flag in ("--enable-force-include-usage", "--enable-prompt-tokens-details"):
        assert _flag_kind(flag) in ("switch", "negatable")
