"""vLLM's `serve` command lines, made ours before the flags are parsed.

What a vLLM user copies from a model card should start the same server or be refused in one
line that says why: `--model X` is the positional MODEL; flags that take several values in vLLM
(`--api-key k1 k2`) repeat ours; `--config file.yaml` holds flags as keys; `--max-model-len 32k`
reads as vLLM reads it; vLLM's flags that change nothing for one model on one device are
dropped with a note; those that could only hold one value here are checked against it
(`--tensor-parallel-size 2` is refused, `1` passes). Anything else goes to the parser as typed,
so a real typo still gets its suggestion.

PURE (no torch).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aioinfer.offline.llm_options import FIXED_VLLM_OPTIONS

_GRAPHS = "CUDA graphs cover every decode batch shape"
_BUDGET = "prompts are chunked by the token budget alone"
# vLLM flags that change nothing here, with the number of values each takes, and why.
IGNORED_FLAGS: dict[str, tuple[int, str]] = {
    "--trust-remote-code": (0, "no code from a model repository is ever run"),
    "--enable-chunked-prefill": (0, "prompts are always chunked"),
    "--no-enable-chunked-prefill": (0, "prompts are always chunked"),
    "--disable-log-stats": (0, "the statistics line is logged only while requests run"),
    "--disable-log-requests": (0, "requests are logged only with --log-requests"),
    "--disable-fastapi-docs": (0, "the server publishes only /openapi.json"),
    "--disable-uvicorn-access-log": (0, "there is no access log"),
    "--disable-custom-all-reduce": (0, "one device"),
    "--swap-space": (1, "preempted requests are recomputed, never swapped"),
    "--max-seq-len-to-capture": (1, _GRAPHS),
    "--compilation-config": (1, _GRAPHS),
    "--limit-mm-per-prompt": (1, "the models served take text only"),
    "--root-path": (1, "routes are served at /; a proxy in front strips its prefix"),
    "--uvicorn-log-level": (1, "set AIOINFER_LOGGING_LEVEL instead"),
    "--disable-access-log-for-endpoints": (1, "there is no access log"),
    "--enable-server-load-tracking": (0, "GET /load always counts the requests being answered"),
    "--allowed-methods": (1, "the allowed origins may use every method"),
    "--allowed-headers": (1, "the allowed origins may send any header"),
    "--chat-template-content-format": (1, "a message's text parts are joined for every template"),
    "--disable-frontend-multiprocessing": (0, "the API and the engine are one process"),
    "--api-server-count": (1, "one process serves the API"),
    "--max-cudagraph-capture-size": (1, _GRAPHS),
    "--long-prefill-token-threshold": (1, _BUDGET),
    "--max-num-partial-prefills": (1, _BUDGET),
    "--max-long-partial-prefills": (1, _BUDGET),
}
RENAMED_FLAGS = {"--enable-log-requests": "--log-requests", "--enable-log-outputs": "--log-prompts"}
# vLLM flags of one value with another name here, and what differs.
RENAMED_VALUE_FLAGS = {
    "--max-num-queued-reqs": (
        "--max-queued-requests",
        "it bounds the waiting sequences; vLLM's counts the running ones too",
    ),
}
# vLLM's nargs="+" flags; ours are repeated instead.
MULTI_VALUE_FLAGS = ("--api-key", "--lora-modules", "--allowed-origins", "--served-model-name")
SHORT_FLAGS = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
               "-dp": "--data-parallel-size", "-q": "--quantization"}  # fmt: skip
_OPTIMIZATION_LEVEL = re.compile(r"-O\d?$")  # vLLM's -O3 (compilation level)
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG])")
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


# What one of our flags is: followed by a value, an on-switch, a switch with a --no- form, or
# None for a flag we do not have.
FlagKind = Callable[[str], "str | None"]


def translate(argv: list[str], kind: FlagKind) -> tuple[list[str], list[str]]:
    """`serve`'s arguments (after "serve") in our spelling, and notes on what was dropped.
    `kind(flag)`: "value", "switch", "negatable" or None (not ours). Raises ValueError for a
    vLLM flag at a value that cannot apply here."""
    args = _expand_config(dashed(argv, kind), kind)
    out: list[str] = []
    notes: list[str] = []
    model: str | None = None
    positional: str | None = None
    model_flag = any(a == "--model" or a.startswith("--model=") for a in args)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            if positional is not None and arg != positional:
                raise ValueError(f"one model only: got {positional!r} and {arg!r}")
            positional, i = arg, i + 1
            continue
        flag, eq, inline = arg.partition("=")
        flag = SHORT_FLAGS.get(flag, flag)
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        step = 1 if eq else 2
        option = flag[2:].replace("-", "_")
        if flag == "--model":
            model, i = value, i + step
        elif flag in IGNORED_FLAGS or _OPTIMIZATION_LEVEL.match(flag):
            count, why = IGNORED_FLAGS.get(flag, (int(flag == "-O"), _GRAPHS))
            notes.append(f"{flag} changes nothing here: {why}")
            i += 1 if eq else 1 + count
        elif flag in RENAMED_FLAGS:
            if not eq or inline.lower() not in ("false", "0", "no", "off"):
                out.append(RENAMED_FLAGS[flag])
            i += 1
        elif flag.startswith("--") and option in FIXED_VLLM_OPTIONS:
            if FIXED_VLLM_OPTIONS[option][0] is False:  # a switch: given means on
                raise ValueError(f"{flag} cannot be on here ({FIXED_VLLM_OPTIONS[option][1]})")
            _check_fixed(option, flag, value)
            notes.append(f"{flag} {value} changes nothing here")
            i += step
        elif flag in RENAMED_VALUE_FLAGS and value is not None:
            ours, differs = RENAMED_VALUE_FLAGS[flag]
            notes.append(f"{flag} {value} is read as {ours} {value}: {differs}")
            out += [ours, value]
            i += step
        elif flag == "--max-model-len" and value is not None:
            out += [flag, _max_model_len(value)]
            i += step
        elif flag == "--kv-cache-memory-bytes" and value is not None:
            out += [flag, _human_int(value)]
            i += step
        elif flag in MULTI_VALUE_FLAGS and not eq and value is not None:
            # The first value is taken whatever it looks like (a key may start with "-"). More
            # follow as in vLLM only once the model is known (`vllm serve MODEL --api-key a
            # b`). Before it, a bare word is the model where it looks like one: a local path or
            # GGUF, or after flags other than --api-key an owner/name hub id (a key taken for
            # the model would be logged and sent to the hub). Any other word is refused.
            out += [flag, value]
            i += 2
            model_seen = model_flag or positional is not None
            bare = i < len(args) and not args[i].startswith("-")
            if not model_seen and bare and not _looks_like_model(args[i], flag != "--api-key"):
                raise ValueError(
                    f"{flag} takes several values only after the model: aioinfer serve MODEL "
                    f"{flag} A B (or {flag} once for each value)"
                )
            while model_seen and i < len(args) and not args[i].startswith("-"):
                if args[i] == positional:
                    break
                out += [flag, args[i]]
                i += 1
        else:
            out.append(arg)
            # A flag not ours may be a switch: the next flag is never its value.
            flag_kind = kind(flag)
            has_value = (
                not eq
                and value is not None
                and (flag_kind == "value" or (flag_kind is None and not value.startswith("--")))
            )
            if has_value:
                out.append(value)  # type: ignore[arg-type]
            i += 2 if has_value else 1
    if model is not None and positional is not None and model != positional:
        raise ValueError(f"the model is given twice: {positional!r} and --model {model!r}")
    chosen = positional or model
    return ([chosen] if chosen else []) + out, notes


def _looks_like_model(word: str, hub_id: bool) -> bool:
    """A local path or GGUF file, or with `hub_id` an id of the form owner/name."""
    local = Path(word).exists() or word.endswith(".gguf")
    return local or (hub_id and _HUB_ID.fullmatch(word) is not None)


def _check_fixed(option: str, flag: str, value: str | None) -> None:
    only, why = FIXED_VLLM_OPTIONS[option]
    allowed = {str(only).lower()} | ({"none", ""} if only is None else set())
    if value is None or value.lower() not in allowed:
        must = "cannot be set" if only is None else f"must be {only}"
        raise ValueError(f"{flag} {must} here ({why}), got {value}")


def dashed(argv: list[str], kind: FlagKind) -> list[str]:
    """argv with vLLM's underscore spellings of flags (`--gpu_memory_utilization 0.9`, as Helm
    charts pass them) written with dashes. Values stay as they are, also one that starts with
    "--" after a flag of ours that takes one (an API key, say)."""
    out: list[str] = []
    takes_value = False
    for arg in argv:
        if not takes_value and arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            flag = "--" + flag[2:].replace("_", "-")
            takes_value = not eq and (kind(flag) == "value" or flag in MULTI_VALUE_FLAGS)
            arg = flag + eq + value
        else:
            takes_value = False
        out.append(arg)
    return out


def human_number_args(argv: list[str], kind: FlagKind) -> list[str]:
    """argv with the values of --max-model-len (32k, auto -> -1) and --kv-cache-memory-bytes
    (8G) as numbers, as `translate` writes them, and flags written with dashes; for `plan`,
    which takes no other vLLM spelling."""
    readers = {"--max-model-len": _max_model_len, "--kv-cache-memory-bytes": _human_int}
    out = dashed(argv, kind)
    for i, arg in enumerate(out):
        flag, eq, inline = arg.partition("=")
        read = readers.get(flag)
        if read is not None and eq:
            out[i] = f"{flag}={read(inline)}"
        elif read is not None and i + 1 < len(out):
            out[i + 1] = read(out[i + 1])
    return out


def _human_int(value: str) -> str:
    """vLLM's forms of a number: 32k (1000s) and 32K (1024s), 1m/1M, 8g/8G."""
    match = _HUMAN_INT.fullmatch(value)
    return str(int(float(match[1]) * _UNITS[match[2]])) if match is not None else value


def _max_model_len(value: str) -> str:
    """A number as _human_int reads it, or auto (-1: the model's, lowered to what the KV cache
    holds)."""
    return "-1" if value == "auto" else _human_int(value)


def _expand_config(argv: list[str], kind: FlagKind) -> list[str]:
    """argv with `--config FILE` replaced by the flags its YAML mapping holds (before the
    other flags, which win over it as in vLLM)."""
    found = [i for i, arg in enumerate(argv) if arg.partition("=")[0] == "--config"]
    if not found:
        return argv
    if len(found) > 1:
        raise ValueError("--config is given more than once")
    i = found[0]
    _, eq, inline = argv[i].partition("=")
    path = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if not path or path.startswith("-"):
        raise ValueError("--config needs a YAML file")
    rest = argv[:i] + argv[i + (1 if eq else 2) :]
    # A flag of several values on the command line replaces the file's values, not adds to them.
    replaced = {a.partition("=")[0] for a in rest} & set(MULTI_VALUE_FLAGS)
    return _config_flags(Path(path), kind, replaced) + rest


def _config_flags(path: Path, kind: FlagKind, replaced: set[str]) -> list[str]:
    import yaml

    try:
        data: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flags to values")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or flag in replaced:  # unset, as vLLM reads it; or given again
            continue
        if key == "model":
            flags.append(str(value))
        elif isinstance(value, bool):  # a switch
            if value:
                flags.append(flag)
            elif kind(flag) == "negatable":
                flags.append(f"--no-{flag[2:]}")
        elif isinstance(value, list):
            if flag not in MULTI_VALUE_FLAGS:
                raise ValueError(f"--config {path}: {key} takes one value, got a list")
            for item in value:
                flags += [flag, _text(item)]
        else:
            flags += [flag, _text(value)]
    return flags


def _text(value: Any) -> str:
    """A YAML value as a flag's text: mappings as JSON (vLLM's JSON flags)."""
    import json

    return json.dumps(value) if isinstance(value, dict) else str(value)
