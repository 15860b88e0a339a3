"""`aioinfer bench overhead`: what a server spends per token outside the model.

The model is a 2-layer, 64-wide Llama with random weights (`--load-format dummy`) and SmolLM2's
tokenizer: its forward pass costs almost nothing, so throughput measures the host path of each
token (scheduling, inputs, sampling, applying, detokenizing, fanning out, writing SSE). vLLM
takes the same folder (its CPU attention needs head_dim 32 or more, hence 2 heads of 32).

Three figures:
- streamed /v1/completions at each concurrency: `max_tokens` = `min_tokens` tokens each, EOS
  ignored, driven by wrk (a C load generator: the client must not be the bottleneck) with a Lua
  script that builds each body (errors: wrk's count of failed connections and non-2xx answers);
  without wrk, an aiohttp client in a process of its own, which also checks that each stream
  ends in [DONE]; the client's CPU seconds are reported beside the figure;
- offline `LLM.generate` on the same model;
- for aioinfer, host microseconds per output token by phase, from `aioinfer:host_seconds_total`
  (the server's /metrics) over the streamed runs.
Against a peer (`--base-url` of a server already running it), only the streamed runs apply;
scripts/bench_peers.sh runs both and the peer's offline figure in one go.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# SmolLM2's vocabulary; head_dim 32.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
SERVED_NAME = "host-overhead"
WORDS = (
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
    "child", "eye", "woman", "place", "work", "week", "case", "point", "number", "group",
    "problem", "fact",
)  # fmt: skip
READY_TIMEOUT = 180.0


@dataclass
class OverheadConfig:
    concurrencies: tuple[int, ...] = (64, 256)
    duration: float = 20.0  # seconds of load per concurrency
    output_len: int = 128
    prompt_words: int = 32
    offline_prompts: int = 512
    base_url: str | None = None  # a running server (a peer); None: start aioinfer here
    model: str = SERVED_NAME
    offline: bool = True
    client: str = "auto"  # wrk, python or auto (wrk where installed)
    result_file: str | None = None
    server_args: tuple[str, ...] = ()  # more `aioinfer serve` flags
    seed: int = 0


@dataclass
class StreamRun:
    concurrency: int
    client: str
    requests: int
    errors: int
    seconds: float
    output_len: int
    client_cpu_seconds: float
    host_us_per_token: dict[str, float] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.requests * self.output_len / self.seconds


def prepare_model(folder: Path) -> Path:
    """The tiny model's folder: its config and SmolLM2's tokenizer files (from the bundled
    GGUF), which vLLM reads too."""
    from transformers import AutoTokenizer

    from aioinfer.model.loader.resolve import bundled_gguf_path

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    if not (folder / "tokenizer.json").is_file():
        gguf = bundled_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- the load

WRK_SCRIPT = """
math.randomseed(%(seed)d)
local words = {%(words)s}
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"

request = function()
  local prompt = {}
  for i = 1, %(prompt_words)d do prompt[i] = words[math.random(#words)] end
  local body = string.format(
    '{"model":"%(model)s","prompt":"%%s","max_tokens":%(output_len)d,"min_tokens":%(output_len)d,'
    .. '"ignore_eos":true,"stream":true,"temperature":0}', table.concat(prompt, " "))
  return wrk.format(nil, "/v1/completions", nil, body)
end

done = function(summary, latency, requests)
  io.write(string.format('\\nRESULT {"requests": %%d, "seconds": %%f, "socket_errors": %%d}\\n',
    summary.requests, summary.duration / 1e6,
    summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.status + summary.errors.timeout))
end
"""


def run_wrk(base_url: str, config: OverheadConfig, concurrency: int) -> StreamRun:
    script = WRK_SCRIPT % {
        "seed": config.seed,
        "words": ", ".join(f'"{w}"' for w in WORDS),
        "prompt_words": config.prompt_words,
        "model": config.model,
        "output_len": config.output_len,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{concurrency}", f"-d{config.duration:g}s", "--timeout", "60s",
             "-s", f.name, base_url],
            capture_output=True, text=True, timeout=config.duration + 120, check=True,
        ).stdout  # fmt: skip
    finally:
        os.unlink(f.name)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    match = re.search(r"^RESULT (\{.*\})$", out, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    result = json.loads(match[1])
    errors = result["socket_errors"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return StreamRun(concurrency, "wrk", result["requests"], errors, result["seconds"],
                     config.output_len, cpu)  # fmt: skip


def run_python_client(base_url: str, config: OverheadConfig, concurrency: int) -> StreamRun:
    """The same load from aiohttp, in a process of its own (its CPU time is the cost the
    figure carries on a 2-core machine)."""
    args = json.dumps({"base_url": base_url, "concurrency": concurrency,
                       "duration": config.duration, "output_len": config.output_len,
                       "prompt_words": config.prompt_words, "model": config.model,
                       "seed": config.seed})  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-m", "aioinfer.bench.overhead_client", args],
        capture_output=True, text=True, timeout=config.duration + 120, check=True,
    ).stdout  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return StreamRun(concurrency, "python", result["requests"], result["errors"],
                     result["seconds"], config.output_len, cpu)  # fmt: skip


# ----------------------------------------------------------------------------- the server


def host_seconds(base_url: str) -> dict[str, float]:
    """aioinfer's host seconds by phase, and its generated tokens ("tokens"), from /metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        phase = re.match(r'aioinfer:host_seconds_total\{.*phase="(\w+)".*\} (\S+)', line)
        if phase:
            out[phase[1]] = float(phase[2])
        elif line.startswith("aioinfer:generation_tokens_total"):
            out["tokens"] = float(line.split()[-1])
    return out


def per_token(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    tokens = after.get("tokens", 0.0) - before.get("tokens", 0.0)
    if tokens <= 0:
        return {}
    phases = {k: (after[k] - before.get(k, 0.0)) / tokens * 1e6 for k in after if k != "tokens"}
    phases["total"] = sum(phases.values())
    return phases


def wait_healthy(base_url: str, proc: subprocess.Popen[str] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base_url} was not healthy within {timeout:g} s")


def start_server(folder: Path, port: int, extra: tuple[str, ...]) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "aioinfer", "serve", str(folder), "--load-format", "dummy",
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", "256", "--dtype", "float32", *extra]  # fmt: skip
    return subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AIOINFER_LOGGING_LEVEL": "WARNING"},
    )  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- offline


def run_offline(folder: Path, config: OverheadConfig) -> dict[str, float]:
    from aioinfer.core.sampling_params import SamplingParams
    from aioinfer.offline.llm import LLM

    rng = random.Random(config.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(config.prompt_words))
               for _ in range(config.offline_prompts)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=config.output_len,
                            min_tokens=config.output_len, ignore_eos=True)  # fmt: skip
    with LLM(str(folder), load_format="dummy", dtype="float32", max_num_seqs=256,
             seed=config.seed) as llm:  # fmt: skip
        llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompts": len(prompts), "output_tokens": tokens, "seconds": seconds,
            "output_tokens_per_s": tokens / seconds}  # fmt: skip


# ----------------------------------------------------------------------------- the run


def main(config: OverheadConfig) -> dict[str, Any]:
    client = config.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "python"
    load = run_wrk if client == "wrk" else run_python_client
    folder = Path(tempfile.mkdtemp(prefix="aioinfer-overhead-"))
    server = None
    try:
        prepare_model(folder)
        base_url = config.base_url
        if base_url is None:
            port = free_port()
            base_url = f"http://127.0.0.1:{port}"
            server = start_server(folder, port, config.server_args)
        wait_healthy(base_url, server, READY_TIMEOUT)
        ours = config.base_url is None
        runs = []
        for concurrency in config.concurrencies:
            short = OverheadConfig(**{**config.__dict__, "duration": min(3.0, config.duration)})
            load(base_url, short, concurrency)  # warm-up: connections, caches, allocators
            before = host_seconds(base_url) if ours else {}
            run = load(base_url, config, concurrency)
            if ours:
                run.host_us_per_token = per_token(before, host_seconds(base_url))
            runs.append(run)
            print_stream_run(run)
        if server is not None:
            server.terminate()
            server.wait(30)
            server = None
        offline = run_offline(folder, config) if config.offline and ours else None
        if offline is not None:
            print(f"offline: {offline['output_tokens_per_s']:,.0f} output tok/s "
                  f"({offline['prompts']} prompts x {config.output_len} tokens)")  # fmt: skip
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "config": dict(config.__dict__),
        "server": "aioinfer" if ours else config.base_url,
        "streamed": [{**run.__dict__, "output_tokens_per_s": run.output_tokens_per_s}
                     for run in runs],
        "offline": offline,
    }  # fmt: skip
    if config.result_file:
        Path(config.result_file).write_text(json.dumps(result, indent=2))
    return result


def print_stream_run(run: StreamRun) -> None:
    print(f"streamed, {run.concurrency} concurrent ({run.client}): "
          f"{run.output_tokens_per_s:,.0f} output tok/s, {run.requests} requests in "
          f"{run.seconds:.1f} s, {run.errors} errors; client CPU "
          f"{run.client_cpu_seconds:.1f} s")  # fmt: skip
    if run.host_us_per_token:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in run.host_us_per_token.items())
        print(f"  host us per output token: {parts}")
