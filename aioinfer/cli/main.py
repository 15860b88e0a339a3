"""The `aioinfer` command line. Flags are generated from the config dataclasses; no engine logic.

Heavy modules (torch, transformers, aiohttp) are imported inside commands so that `--help`
answers at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time
import types
import typing
from typing import Any

import typer

# Startup time is measured from here: the `Ready in X s` line.
_STARTED_AT = time.perf_counter()

from aioinfer import __version__  # noqa: E402
from aioinfer.config import (  # noqa: E402
    CONFIG_CLASSES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)

app = typer.Typer(
    name="aioinfer",
    help="aioinfer: an LLM inference server for one GPU.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
    pretty_exceptions_enable=False,
)

API_KEY_ENV = "AIOINFER_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # read when ours is not set, as vLLM reads it
_POSITIONAL = {"model"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _config_fields() -> list[tuple[type, dataclasses.Field[Any], Any]]:
    """(config class, field, resolved type) for every flag, in group order."""
    out: list[tuple[type, dataclasses.Field[Any], Any]] = []
    for cls in CONFIG_CLASSES:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append((cls, f, hints[f.name]))
    return out


def _cli_type(tp: Any) -> Any:
    """The type typer should parse: tuples of strings become repeatable options."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        return list[str]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return typing.Optional[args[0]]  # noqa: UP045 - typer needs Optional[...] here
    return tp


def _serve_signature() -> inspect.Signature:
    params = []
    for _cls, f, tp in _config_fields():
        help_text = f.metadata.get("help", "")
        if f.name in _POSITIONAL:
            default: Any = typer.Argument(None, help=help_text, show_default=False)
            annotation: Any = typing.Optional[str]  # noqa: UP045
        else:
            flag = _flag(f.name)
            decls = [f"{flag}/--no-{flag[2:]}"] if tp is bool and f.default else [flag]
            value = list(f.default) if isinstance(f.default, tuple) else f.default
            default = typer.Option(value, *decls, help=help_text)
            annotation = _cli_type(tp)
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
    return inspect.Signature(params)


def build_configs(
    values: dict[str, Any],
) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, ServerConfig]:
    """Sort parsed flag values into the config dataclasses (raises ValueError on bad values)."""
    values = dict(values)
    if values.get("model") is None:
        values["model"] = ""
    keys = list(values.get("api_key") or [])
    if any(not key.strip() for key in keys):  # `--api-key "$KEY"` with KEY unset
        raise ValueError("--api-key must not be empty (is the variable it reads unset?)")
    if any(key != key.strip() for key in keys):  # a client's key is compared stripped
        raise ValueError(
            "--api-key must not begin or end with whitespace: no client could send such a key"
        )
    if not keys:  # --api-key wins over the variables, as in vLLM; an empty one is not set
        env_keys = os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or ""
        keys = [k.strip() for k in env_keys.split(",") if k.strip()]
    values["api_key"] = keys
    for _cls, f, tp in _config_fields():  # repeatable flags come as lists
        if typing.get_origin(tp) is tuple and isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    built: list[Any] = []
    for cls in CONFIG_CLASSES:
        names = {f.name for f in dataclasses.fields(cls)}
        built.append(cls(**{k: v for k, v in values.items() if k in names}))
    model, cache, scheduler, server = built
    if server.lora_modules and not model.enable_lora:
        # Known now: not after the weights load and the engine starts.
        raise ValueError("--lora-modules needs --enable-lora")
    return model, cache, scheduler, server


def serve(**values: Any) -> None:
    """Serve a model over the OpenAI-compatible HTTP API."""
    try:
        configs = build_configs(values)
    except ValueError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    from aioinfer.server.launch import run_server

    code = run_server(*configs, started_at=_STARTED_AT)
    raise typer.Exit(code)


serve.__signature__ = _serve_signature()  # type: ignore[attr-defined]
app.command(
    "serve",
    help=(
        "Serve MODEL (a Hugging Face hub id, a local folder or a .gguf file; default: the "
        "bundled SmolLM2-135M-Instruct). --help=all lists every flag, --help=GROUP one group, "
        "--help=FLAG one flag."
    ),
    add_help_option=False,
)(serve)


# ----------------------------------------------------------------------------- bench

bench_app = typer.Typer(help="Benchmarks, each run side by side with a peer where one applies.")
app.add_typer(bench_app, name="bench")


@bench_app.command("throughput")
def bench_throughput(
    model: str = typer.Argument("", help="Model (default: the bundled SmolLM2-135M-Instruct)."),
    num_prompts: int = typer.Option(64, help="Number of prompts."),
    input_len: str = typer.Option("128", help="Prompt tokens, or a uniform range LO:HI."),
    output_len: str = typer.Option("128", help="Output tokens, or a uniform range LO:HI."),
    vs: str = typer.Option(None, help="Also run a peer in the same process: 'transformers'."),
    hf_batch_size: int = typer.Option(64, help="Batch size of the transformers peer."),
    seed: int = typer.Option(0, help="Seed of the random prompts."),
    result_file: str = typer.Option(None, help="Write the results as JSON here."),
    dtype: str = typer.Option("auto", help="Model dtype."),
    max_num_seqs: int = typer.Option(256, help="Most requests in one step."),
    max_num_batched_tokens: int = typer.Option(None, help="Token budget of one step."),
    kv_cache_memory: float = typer.Option(4.0, help="KV cache GiB on the CPU."),
    gpu_memory_utilization: float = typer.Option(
        0.92, help="Share of the GPU for our engine (lower it to leave the peer room)."
    ),
    load_format: str = typer.Option("auto", help="auto or dummy."),
    cpu_weight_format: str = typer.Option(
        "auto", help="auto, coded or float32: exact byte codes of GGUF weights (serve --help)."
    ),
    cpu_amx: bool = typer.Option(True, help="AMX linears where the CPU has AMX (serve --help)."),
    rounds: int = typer.Option(1, help="Runs of each engine, in turn; each ratio and the median."),
) -> None:
    """Offline throughput through LLM, optionally against transformers' generate."""
    from aioinfer.bench.throughput import main as run
    from aioinfer.startup_log import setup_logging

    setup_logging("WARNING")
    options = {
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "kv_cache_memory": kv_cache_memory,
        "gpu_memory_utilization": gpu_memory_utilization,
        "load_format": load_format,
        "cpu_weight_format": cpu_weight_format,
        "cpu_amx": cpu_amx,
    }
    run(model, num_prompts, input_len, output_len, vs, hf_batch_size, seed, result_file, options,
        rounds)  # fmt: skip


@bench_app.command("overhead")
def bench_overhead(
    concurrency: str = typer.Option("64,256", help="Concurrent streams, comma-separated."),
    duration: float = typer.Option(20.0, help="Seconds of load at each concurrency."),
    output_len: int = typer.Option(128, help="Output tokens of each request (EOS ignored)."),
    offline_prompts: int = typer.Option(512, help="Prompts of the offline run (0: none)."),
    base_url: str = typer.Option(
        None, help="A server already serving the tiny model (a peer); default: start aioinfer."
    ),
    model: str = typer.Option("host-overhead", help="The model name to request."),
    client: str = typer.Option("auto", help="wrk, python, or auto (wrk where installed)."),
    result_file: str = typer.Option(None, help="Write the results as JSON here."),
    prepare: str = typer.Option(
        None, help="Only write the tiny model's folder here (for a peer to serve), then exit."
    ),
    server_args: str = typer.Option(
        "", help="More flags for the aioinfer server it starts, e.g. '--stream-interval 8'."
    ),
) -> None:
    """Host overhead per token: a near-free model, streamed and offline (see bench/overhead.py)."""
    import shlex
    from pathlib import Path

    from aioinfer.bench.overhead import OverheadConfig, prepare_model
    from aioinfer.bench.overhead import main as run

    if prepare:
        print(prepare_model(Path(prepare)))
        return
    if client not in ("wrk", "python", "auto"):
        raise typer.BadParameter("client must be wrk, python or auto", param_hint="--client")
    levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
    run(
        OverheadConfig(
            concurrencies=levels, duration=duration, output_len=output_len,
            offline_prompts=offline_prompts, base_url=base_url, model=model,
            offline=offline_prompts > 0, client=client, result_file=result_file,
            server_args=tuple(shlex.split(server_args)),
        )
    )  # fmt: skip


@bench_app.command("serve")
def bench_serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", help="Root URL of the server."),
    model: str = typer.Option(None, help="Model to request (default: the server's first)."),
    endpoint: str = typer.Option("completions", help="completions or chat."),
    dataset: str = typer.Option("random", help="random or sharegpt-like."),
    num_prompts: int = typer.Option(64, help="Number of requests."),
    input_len: int = typer.Option(128, help="Prompt tokens (random dataset)."),
    output_len: int = typer.Option(128, help="Output tokens (random dataset)."),
    concurrency: int = typer.Option(None, help="Most requests in flight (default: no cap)."),
    request_rate: float = typer.Option(
        float("inf"), help="Requests per second, Poisson arrivals; inf sends all at once."
    ),
    seed: int = typer.Option(0, help="Seed of the prompts and the arrivals."),
    result_file: str = typer.Option(None, help="Write the results as JSON here."),
    api_key: str = typer.Option(None, envvar="OPENAI_API_KEY", help="Bearer token to send."),
    ignore_eos: str = typer.Option(
        "param",
        help="param: send ignore_eos (vLLM, aioinfer); min-tokens: also min_tokens "
        "(llama-cpp-python); none: neither.",
    ),
    timeout: float = typer.Option(600.0, help="Seconds one request may take."),
    tokenizer: str = typer.Option(
        None, help="Tokenizer (hub id, folder or .gguf) for exact prompt token counts."
    ),
    warmup: int = typer.Option(1, help="Uncounted warm-up requests."),
    allow_remote: bool = typer.Option(False, help="Allow a server that is not on loopback."),
    temperature: float = typer.Option(0.0, help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(None, help="top_p to send (default: none)."),
    top_k: int = typer.Option(None, help="top_k to send (default: none)."),
) -> None:
    """Load an OpenAI-compatible server (aioinfer, vLLM, llama.cpp) as `vllm bench serve` does."""
    from aioinfer.bench.serve import BenchError, ServeBenchConfig
    from aioinfer.bench.serve import main as run

    try:
        config = ServeBenchConfig(
            base_url=base_url,
            model=model,
            endpoint=endpoint,
            dataset=dataset,
            num_prompts=num_prompts,
            input_len=input_len,
            output_len=output_len,
            concurrency=concurrency,
            request_rate=request_rate,
            seed=seed,
            result_file=result_file,
            api_key=api_key,
            ignore_eos=ignore_eos,
            timeout=timeout,
            tokenizer=tokenizer,
            allow_remote=allow_remote,
            warmup=warmup,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )
    except ValueError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        result = run(config)
    except BenchError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(1) from None
    if result["completed"] == 0:
        raise typer.Exit(1)


@bench_app.command("latency")
def bench_latency(
    model: str = typer.Argument("", help="Model (default: the bundled SmolLM2-135M-Instruct)."),
    input_len: int = typer.Option(128, help="Prompt tokens (random ids) unless --prompt is given."),
    output_len: int = typer.Option(128, help="Output tokens (at least 2)."),
    prompt: str = typer.Option(None, help="Prompt text to use instead of random ids."),
    num_iters: int = typer.Option(5, help="Measured iterations; medians are reported."),
    num_iters_warmup: int = typer.Option(1, help="Uncounted iterations before them."),
    seed: int = typer.Option(0, help="Seed of the random prompt."),
    result_file: str = typer.Option(None, help="Write the results as JSON here."),
    bandwidth_mib: int = typer.Option(1024, help="MiB copied to measure memory bandwidth."),
    dtype: str = typer.Option("auto", help="Model dtype."),
    device: str = typer.Option("auto", help="auto, cuda or cpu."),
    max_model_len: int = typer.Option(None, help="Longest prompt plus output."),
    kv_cache_memory: float = typer.Option(4.0, help="KV cache GiB on the CPU."),
    load_format: str = typer.Option("auto", help="auto or dummy."),
    enforce_eager: bool = typer.Option(False, help="Never capture CUDA graphs."),
    enable_prefix_caching: bool = typer.Option(
        False, help="Reuse the prompt's KV cache between iterations (skips the prefill)."
    ),
    cpu_weight_format: str = typer.Option(
        "auto", help="auto, coded or float32: exact byte codes of GGUF weights (serve --help)."
    ),
    cpu_amx: bool = typer.Option(True, help="AMX linears where the CPU has AMX (serve --help)."),
) -> None:
    """Batch-1 TTFT and TPOT through LLM, beside the memory-bandwidth floor of a decode step."""
    from aioinfer.bench.latency import main as run
    from aioinfer.startup_log import setup_logging

    setup_logging("WARNING")
    options = {
        "dtype": dtype,
        "device": device,
        "max_model_len": max_model_len,
        "kv_cache_memory": kv_cache_memory,
        "load_format": load_format,
        "enforce_eager": enforce_eager,
        "enable_prefix_caching": enable_prefix_caching,
        "cpu_weight_format": cpu_weight_format,
        "cpu_amx": cpu_amx,
    }
    try:
        run(
            model, input_len, output_len, num_iters, num_iters_warmup, prompt, seed,
            result_file, options, bandwidth_mib,
        )  # fmt: skip
    except ValueError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None


@bench_app.command(
    "startup",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def bench_startup(
    ctx: typer.Context,
    runs: int = typer.Option(3, help="Starts per server; the table shows medians."),
    vs: str = typer.Option(
        None,
        help="Another server command, timed the same way in the same run, e.g. 'vllm serve "
        "MODEL'. {port} in it is replaced by a free port; without it --host/--port are appended.",
    ),
    vs_name: str = typer.Option(None, help="Name of the --vs server in the table."),
    cold: bool = typer.Option(
        False, help="Give each of our starts an empty cache (a GGUF is converted every time)."
    ),
    timeout: float = typer.Option(600.0, help="Seconds one start may take."),
    result_file: str = typer.Option(None, help="Write every run and the medians as JSON here."),
) -> None:
    """Time `aioinfer serve` from spawn to the first 200 from /health and to a first 1-token
    completion. MODEL and every flag not listed here go to serve as they are."""
    from aioinfer.bench.startup import main as run

    run(list(ctx.args), runs, vs, cold, timeout, result_file, vs_name)


# ----------------------------------------------------------------------------- clients


def _config_option(name: str) -> Any:
    """A typer.Option with the default and help text of the config field `name`."""
    for _cls, f, _tp in _config_fields():
        if f.name == name:
            return typer.Option(f.default, help=f.metadata.get("help", ""))
    raise KeyError(name)


_URL_HELP = "URL of a running aioinfer server (or any OpenAI-compatible one)."
_API_KEY_HELP = f"API key (default: the first key in ${API_KEY_ENV})."


@app.command("chat")
def chat(
    url: str = typer.Option("http://127.0.0.1:8000", help=_URL_HELP),
    api_key: str = typer.Option(None, help=_API_KEY_HELP),
    model: str = typer.Option(None, help="Model (default: the first the server lists)."),
    system: str = typer.Option(None, help="System prompt."),
    max_tokens: int = typer.Option(None, help="Most tokens per reply (default: up to the limit)."),
    temperature: float = typer.Option(None, help="Sampling temperature (default: the server's)."),
) -> None:
    """Chat with a running server: streamed replies, history kept.

    /exit or Ctrl-D quits; /clear forgets the conversation.
    """
    from aioinfer.cli.client import chat_main

    raise typer.Exit(chat_main(url, api_key, model, system, max_tokens, temperature))


@app.command("complete")
def complete(
    prompt: str = typer.Argument(..., help="The prompt; '-' reads it from stdin."),
    url: str = typer.Option("http://127.0.0.1:8000", help=_URL_HELP),
    api_key: str = typer.Option(None, help=_API_KEY_HELP),
    model: str = typer.Option(None, help="Model (default: the first the server lists)."),
    max_tokens: int = typer.Option(256, help="Most tokens to generate."),
    temperature: float = typer.Option(None, help="Sampling temperature (default: the server's)."),
) -> None:
    """Stream the completion of one prompt (plain text, no chat template)."""
    from aioinfer.cli.client import complete_main

    raise typer.Exit(complete_main(prompt, url, api_key, model, max_tokens, temperature))


# ----------------------------------------------------------------------------- plan


@app.command("plan")
def plan(
    model: str = typer.Argument("", help="Model (default: the bundled SmolLM2-135M-Instruct)."),
    gpu_memory: float = typer.Option(
        None, help="Plan for a GPU with this many GiB (default: the local GPU; none: the CPU)."
    ),
    non_torch_memory: float = typer.Option(
        None, help="GiB used outside torch (default: measured on the local GPU, else 0.5)."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    revision: str = _config_option("revision"),
    served_model_name: list[str] = _config_option("served_model_name"),
    dtype: str = _config_option("dtype"),
    device: str = _config_option("device"),
    max_model_len: int = _config_option("max_model_len"),
    block_size: int = _config_option("block_size"),
    gpu_memory_utilization: float = _config_option("gpu_memory_utilization"),
    kv_cache_memory: float = _config_option("kv_cache_memory"),
    kv_cache_memory_bytes: int = _config_option("kv_cache_memory_bytes"),
    num_gpu_blocks_override: int = _config_option("num_gpu_blocks_override"),
    max_num_seqs: int = _config_option("max_num_seqs"),
    max_num_batched_tokens: int = _config_option("max_num_batched_tokens"),
    runner: str = _config_option("runner"),
    pooler_config: str = _config_option("pooler_config"),
    cpu_kernels: str = _config_option("cpu_kernels"),
    cpu_weight_format: str = _config_option("cpu_weight_format"),
    cpu_amx: bool = _config_option("cpu_amx"),
) -> None:
    """Predict serve's memory numbers without loading weights.

    Weights, KV cache size and maximum concurrency as `serve MODEL` would print them. Exit code 1:
    serve would refuse these settings.
    """
    from aioinfer.cli.plan import plan_main

    flags = {
        "revision": revision,
        "served_model_name": served_model_name,
        "dtype": dtype,
        "device": device,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "kv_cache_memory": kv_cache_memory,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "num_gpu_blocks_override": num_gpu_blocks_override,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "runner": runner,
        "pooler_config": pooler_config,
        "cpu_kernels": cpu_kernels,
        "cpu_weight_format": cpu_weight_format,
        "cpu_amx": cpu_amx,
    }
    code = plan_main(
        model,
        gpu_memory=gpu_memory,
        non_torch_memory=non_torch_memory,
        as_json=json_output,
        **flags,
    )
    raise typer.Exit(code)


# ----------------------------------------------------------------------------- serve --help


def serve_help(topic: str | None) -> str:
    """Text for `serve --help[=topic]`: groups, all, a group name or a flag name."""
    groups: dict[str, list[tuple[dataclasses.Field[Any], Any]]] = {}
    for cls, f, tp in _config_fields():
        groups.setdefault(cls.__name__, []).append((f, tp))
    if topic is None:
        lines = ["Usage: aioinfer serve [MODEL] [OPTIONS]", "", "Option groups:"]
        for name, fields in groups.items():
            flags = ", ".join(_flag(f.name) for f, _ in fields if f.name not in _POSITIONAL)
            lines.append(f"  {name}: {flags}")
        lines += ["", "Use --help=all, --help=<GroupName> or --help=<flag-name> for details."]
        return "\n".join(lines)
    wanted = topic.lower().removeprefix("--").replace("_", "-")
    if wanted == "all":
        return "\n\n".join(_describe_group(n, fs) for n, fs in groups.items())
    for name, fields in groups.items():
        if name.lower() == wanted:
            return _describe_group(name, fields)
    fields = [field for group in groups.values() for field in group]
    for f, tp in fields:
        negation = f"no-{f.name.replace('_', '-')}" if tp is bool and f.default else None
        if wanted in (f.name.replace("_", "-"), negation):
            return _describe_field(f, tp)
    matches = [_describe_field(f, tp) for f, tp in fields if wanted in f.name.replace("_", "-")]
    if matches:  # a part of flag names, as vLLM's --help=prefix
        return "\n".join(matches)
    from aioinfer.cli.vllm_args import IGNORED_FLAGS, RENAMED_FLAGS, RENAMED_VALUE_FLAGS

    vllm_flag = f"--{wanted}"
    if vllm_flag in IGNORED_FLAGS:
        return f"  {vllm_flag}  (vLLM's) dropped with a note: {IGNORED_FLAGS[vllm_flag][1]}"
    ours, differs = RENAMED_VALUE_FLAGS.get(vllm_flag, (RENAMED_FLAGS.get(vllm_flag), ""))
    if ours:
        head = f"  {vllm_flag}  (vLLM's) read as {ours}{differs and ': '}{differs}"
        return head + "\n" + serve_help(ours)
    raise KeyError(topic)


def _describe_group(name: str, fields: list[tuple[dataclasses.Field[Any], Any]]) -> str:
    return "\n".join([f"{name}:", *(_describe_field(f, tp) for f, tp in fields)])


def _describe_field(f: dataclasses.Field[Any], tp: Any) -> str:
    name = "MODEL (argument)" if f.name in _POSITIONAL else _flag(f.name)
    if tp is bool and f.default:
        name += f" / --no-{f.name.replace('_', '-')}"
    return f"  {name}  [default: {f.default!r}]\n      {f.metadata.get('help', '')}"


def _serve_help_requested(argv: list[str]) -> str | bool | None:
    """The topic of a `serve --help[=topic]` in argv; False when there is none."""
    if not argv or argv[0] != "serve":
        return False
    for arg in argv[1:]:
        if arg in ("--help", "-h"):
            return None
        if arg.startswith("--help="):
            return arg.split("=", 1)[1]
    return False


# ----------------------------------------------------------------------------- entry point


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"aioinfer {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """aioinfer: an LLM inference server for one GPU."""


def main() -> None:
    argv = sys.argv[1:]
    topic = _serve_help_requested(argv)
    if topic is not False:
        try:
            print(serve_help(topic))  # type: ignore[arg-type]
        except KeyError:
            print(f"Unknown help topic {topic!r}.\n\n{serve_help(None)}", file=sys.stderr)
            sys.exit(2)
        except BrokenPipeError:  # `--help=all | head`
            sys.stderr.close()
        sys.exit(0)
    if argv and argv[0] == "serve":
        from aioinfer.cli.vllm_args import translate

        try:
            serve_args, notes = translate(argv[1:], _flag_kind)
        except ValueError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            sys.exit(2)
        for note in notes:
            print(f"Note: {note}", file=sys.stderr)
        argv = ["serve", *serve_args]
    elif argv and argv[0] == "plan":
        from aioinfer.cli.vllm_args import human_number_args

        argv = ["plan", *human_number_args(argv[1:], _flag_kind)]
    app(args=argv)


def _flag_kind(flag: str) -> str | None:
    """What one of `serve`'s flags is: "value" (followed by one), "switch" (on when given),
    "negatable" (with a --no- form) or None when it is not one of ours."""
    for _cls, f, tp in _config_fields():
        name = f.name.replace("_", "-")
        if flag == f"--{name}":
            return ("negatable" if f.default else "switch") if tp is bool else "value"
        if tp is bool and f.default and flag == f"--no-{name}":
            return "switch"
    return None
