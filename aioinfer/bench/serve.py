"""`aioinfer bench serve`: a load generator for any OpenAI-compatible server (aioinfer, vLLM,
llama.cpp), with the metric definitions of vLLM's `vllm bench serve`.

Every request streams (`stream_options.include_usage`), decodes greedily unless told otherwise
(vLLM's tool leaves the temperature to the server) and, with `--ignore-eos param`, sends
`ignore_eos` as vLLM's tool does; `--ignore-eos min-tokens` also sends `min_tokens` for servers
that read only that (llama-cpp-python), which vLLM's would charge a logits processor every step.
Per request:

- TTFT: from sending the request to the first chunk with non-empty text.
- E2E: from sending the request to the last chunk that carries choices.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- ITL: every gap between consecutive non-empty text chunks, pooled over all requests.

Output tokens come from the usage chunk; a server that sends none has them counted by the
tokenizer (`--tokenizer`) or as one per text chunk. Prompt tokens come from usage too, else from
the dataset. Throughputs count successful requests over the wall time from the first send to
the last completion; the warm-up request is not part of it. Arrivals are all at once
(`--request-rate inf`) or a Poisson process, capped by `--concurrency` requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import math
import random
import re
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from aioinfer.bench.datasets import DATASETS, Sample, load_tokenizer, make_dataset

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
IGNORE_EOS_MODES = ("param", "min-tokens", "none")
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")
_ERROR_SAMPLES = 5


class BenchError(RuntimeError):
    """The benchmark cannot run at all (unreachable server, failed warm-up, no model)."""


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"
    dataset: str = "random"
    num_prompts: int = 64
    input_len: int = 128  # random dataset only
    output_len: int = 128  # random dataset only
    concurrency: int | None = None  # most requests in flight; None: no cap
    request_rate: float = math.inf  # requests per second (Poisson); inf: all at once
    seed: int = 0
    result_file: str | None = None
    api_key: str | None = None
    ignore_eos: str = "param"
    timeout: float = 600.0  # seconds, per request
    tokenizer: str | None = None
    allow_remote: bool = False
    warmup: int = 1
    # Sampling: greedy unless set; top_p / top_k only when set.
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self) -> None:
        choices = {
            "endpoint": tuple(ENDPOINTS),
            "dataset": DATASETS,
            "ignore_eos": IGNORE_EOS_MODES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("num_prompts", "input_len", "output_len", "concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        for name in ("request_rate", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_base_url(self.base_url, self.allow_remote)


def check_base_url(base_url: str, allow_remote: bool = False) -> None:
    """Raise ValueError unless base_url is http(s) on a loopback host (or allow_remote)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base_url must be an http(s) URL with a host, got {base_url!r}")
    if allow_remote or _is_loopback(parts.hostname):
        return
    raise ValueError(
        f"base_url host {parts.hostname!r} is not a loopback address; "
        "pass --allow-remote to load a server on another machine"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def arrival_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: all zero for an infinite rate, else a Poisson process (the
    first request at 0, exponential gaps of mean 1/rate), the same for the same seed."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}")
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


def build_payload(config: ServeBenchConfig, model: str, sample: Sample) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": sample.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.top_p is not None:
        payload["top_p"] = config.top_p
    if config.top_k is not None:
        payload["top_k"] = config.top_k
    if config.endpoint == "chat":
        payload["messages"] = sample.messages
    else:
        payload["prompt"] = sample.prompt
    if config.ignore_eos != "none":
        payload["ignore_eos"] = True  # vLLM and aioinfer
    if config.ignore_eos == "min-tokens":
        payload["min_tokens"] = sample.output_len  # llama-cpp-python honours only this
    return payload


# ----------------------------------------------------------------------------- one request


@dataclass
class RequestRecord:
    """What one request measured; times are seconds from its own send."""

    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks with non-empty text
    text: str = ""
    output_tokens: int | None = None  # from usage
    prompt_tokens: int | None = None  # from usage
    error: str | None = None


class _StreamState:
    def __init__(self, record: RequestRecord, start: float, chat: bool) -> None:
        self.record = record
        self.start = start
        self.chat = chat
        self.last_text: float | None = None
        self.last_choice: float | None = None
        self.parts: list[str] = []


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    timeout: float,
    chat: bool,
) -> RequestRecord:
    """POST one streaming request and time its chunks; never raises for a failed request."""
    record = RequestRecord()
    start = time.perf_counter()
    state = _StreamState(record, start, chat)
    try:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        async with session.post(url, json=payload, headers=headers, timeout=client_timeout) as r:
            if r.status != 200:
                body = (await r.text())[:200]
                record.error = f"HTTP {r.status}: {body}"
                return record
            await _read_events(r, state)
    except Exception as exc:  # any failure of one request is counted, not raised
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    if record.error is None and record.ttft is None:
        record.error = "the stream held no text"
    record.text = "".join(state.parts)
    if state.last_choice is not None:
        record.e2e = state.last_choice - start
    record.ok = record.error is None
    return record


async def _read_events(response: aiohttp.ClientResponse, state: _StreamState) -> None:
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, other SSE fields
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        if not _handle_event(orjson.loads(data), time.perf_counter(), state):
            return


def _handle_event(event: dict[str, Any], now: float, state: _StreamState) -> bool:
    """Fold one SSE event into the record; False ends the stream (an error event)."""
    record = state.record
    if event.get("error") and not event.get("choices"):
        record.error = f"stream error: {str(event['error'])[:200]}"
        return False
    choices = event.get("choices") or []
    if choices:
        state.last_choice = now
        text = "".join(_choice_text(c, state.chat) for c in choices)
        if text:
            _on_text(state, text, now)
    usage = event.get("usage")
    if usage:
        record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    return True


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning is text too: `reasoning` (vLLM, aioinfer) or `reasoning_content` (llama.cpp).
    reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""
    return (delta.get("content") or "") + reasoning


def _on_text(state: _StreamState, text: str, now: float) -> None:
    record = state.record
    record.chunks += 1
    state.parts.append(text)
    if record.ttft is None:
        record.ttft = now - state.start
    elif state.last_text is not None:
        record.itl.append(now - state.last_text)
    state.last_text = now


# ----------------------------------------------------------------------------- the run


async def run_benchmark(config: ServeBenchConfig, progress: bool = False) -> dict[str, Any]:
    """Run the workload once and return the summary (see `summarize`)."""
    check_base_url(config.base_url, config.allow_remote)
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    samples = make_dataset(
        config.dataset,
        config.num_prompts,
        config.input_len,
        config.output_len,
        config.seed,
        tokenizer,
    )
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    url = config.base_url.rstrip("/").removesuffix("/v1") + ENDPOINTS[config.endpoint]
    connector = aiohttp.TCPConnector(limit=config.concurrency or 0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        model = config.model or await resolve_model(session, config.base_url, headers)

        async def send(sample: Sample) -> RequestRecord:
            payload = build_payload(config, model, sample)
            return await send_request(
                session, url, payload, headers, config.timeout, config.endpoint == "chat"
            )

        await _warm_up(config, tokenizer, send)
        records, duration = await _dispatch(config, samples, send, progress)
    result = summarize(records, samples, duration, tokenizer)
    vllm_config = {
        "model_id": model,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.concurrency,
    }
    return {"model": model, "config": _config_dict(config), **result, **vllm_config}


async def resolve_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    """The first model id of GET /v1/models."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:  # a wrong --api-key: say so, not that "data" is missing
                text = (await response.text())[:200]
                raise BenchError(f"GET {url} answered {response.status}: {text}")
            body = await response.json(content_type=None)
        return str(body["data"][0]["id"])
    except BenchError:
        raise
    except Exception as exc:
        raise BenchError(
            f"could not read the model from {url} ({type(exc).__name__}: {exc}); pass --model"
        ) from exc


async def _warm_up(
    config: ServeBenchConfig,
    tokenizer: Any,
    send: Callable[[Sample], Awaitable[RequestRecord]],
) -> None:
    """Uncounted requests of the same shape; their own seed keeps them out of the prefix cache
    of the measured prompts."""
    if not config.warmup:
        return
    seed = random.Random(f"warmup-{config.seed}").randrange(2**31)
    samples = make_dataset(
        config.dataset, config.warmup, config.input_len, config.output_len, seed, tokenizer
    )
    for sample in samples:
        record = await send(sample)
        if not record.ok:
            raise BenchError(f"the warm-up request failed: {record.error}")


async def _dispatch(
    config: ServeBenchConfig,
    samples: list[Sample],
    send: Callable[[Sample], Awaitable[RequestRecord]],
    progress: bool,
) -> tuple[list[RequestRecord], float]:
    arrivals = arrival_times(len(samples), config.request_rate, config.seed)
    limit = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    bar = _ProgressBar(len(samples)) if progress else None
    start = time.perf_counter()

    async def one(offset: float, sample: Sample) -> RequestRecord:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit or contextlib.nullcontext():
            record = await send(sample)
        if bar is not None:
            bar.advance()
        return record

    try:
        records = await asyncio.gather(*(one(t, s) for t, s in zip(arrivals, samples, strict=True)))
    finally:
        if bar is not None:
            bar.close()
    return list(records), time.perf_counter() - start


class _ProgressBar:
    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.progress = Progress(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.task = self.progress.add_task("requests", total=total)
        self.progress.start()

    def advance(self) -> None:
        self.progress.update(self.task, advance=1)

    def close(self) -> None:
        self.progress.stop()


# ----------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile does by default."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of seconds, in milliseconds (None when there are no values)."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES)]
    if not values:
        return dict.fromkeys(keys)
    numbers = [statistics.fmean(values), *(percentile(values, q) for q in PERCENTILES)]
    return {k: v * 1000.0 for k, v in zip(keys, numbers, strict=True)}


def output_tokens(record: RequestRecord, tokenizer: Any = None) -> tuple[int, str]:
    """(tokens, source): usage, else the tokenizer on the text, else one per text chunk."""
    if record.output_tokens is not None:
        return record.output_tokens, "usage"
    if tokenizer is not None:
        return len(tokenizer.encode(record.text, add_special_tokens=False)), "tokenizer"
    return record.chunks, "chunks"


def summarize(
    records: Sequence[RequestRecord],
    samples: Sequence[Sample],
    duration: float,
    tokenizer: Any = None,
) -> dict[str, Any]:
    ok = [(r, s) for r, s in zip(records, samples, strict=True) if r.ok]
    counted = [output_tokens(r, tokenizer) for r, _ in ok]
    outs = [n for n, _ in counted]
    prompts = [r.prompt_tokens if r.prompt_tokens is not None else s.prompt_len for r, s in ok]
    ttfts = [r.ttft for r, _ in ok if r.ttft is not None]
    e2es = [r.e2e for r, _ in ok if r.e2e is not None]
    tpots = [
        (r.e2e - r.ttft) / (n - 1)
        for (r, _), n in zip(ok, outs, strict=True)
        if n > 1 and r.e2e is not None and r.ttft is not None
    ]
    itls = [gap for r, _ in ok for gap in r.itl]
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2e": e2es}
    stats = {name: stats_ms(values) for name, values in series.items()}
    errors = [r.error for r in records if not r.ok and r.error]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "error_samples": list(dict.fromkeys(errors))[:_ERROR_SAMPLES],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(outs) / duration,
        "total_token_throughput": (sum(outs) + sum(prompts)) / duration,
        "total_input_tokens": sum(prompts),
        "total_output_tokens": sum(outs),
        "mean_prompt_tokens": statistics.fmean(prompts) if prompts else None,
        "mean_output_tokens": statistics.fmean(outs) if outs else None,
        "short_outputs": sum(n < s.output_len for n, (_, s) in zip(outs, ok, strict=True)),
        "output_tokens_from": sorted({source for _, source in counted}),
        **{f"{name}_ms": values for name, values in stats.items()},
        # The same under `vllm bench serve`'s flat names, for tools that read its files.
        "duration": duration,
        **vllm_metric_keys(series, stats),
    }


def vllm_metric_keys(
    series: Mapping[str, Sequence[float]], stats: Mapping[str, Mapping[str, float | None]]
) -> dict[str, float | None]:
    """mean_/median_/std_/p90_/p99_{name}_ms of each list of seconds (`stats`: its stats_ms),
    as vLLM names them (e2e is its e2el; its std is numpy's, the population's)."""
    out: dict[str, float | None] = {}
    for metric, seconds in series.items():
        name, known = ("e2el" if metric == "e2e" else metric), stats[metric]
        out |= {
            f"mean_{name}_ms": known["mean"],
            f"median_{name}_ms": known["p50"],
            f"std_{name}_ms": statistics.pstdev(seconds) * 1000.0 if seconds else None,
            f"p90_{name}_ms": known["p90"],
            f"p99_{name}_ms": known["p99"],
        }
    return out


def _config_dict(config: ServeBenchConfig) -> dict[str, Any]:
    values = asdict(config)
    values["api_key"] = "***" if config.api_key else None
    if math.isinf(config.request_rate):
        values["request_rate"] = "inf"  # JSON has no infinity
    return values


# ----------------------------------------------------------------------------- report


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    rate = config["request_rate"]
    header = (
        f"{result['model']} at {config['base_url']}: {config['endpoint']}, {config['dataset']}, "
        f"concurrency {config['concurrency'] or 'unlimited'}, "
        f"rate {rate if rate == 'inf' else f'{rate:g} req/s'}"
    )
    table = Table(title="Serving benchmark", caption=header, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("Successful requests", str(result["completed"])),
        ("Failed requests", str(result["failed"])),
        ("Duration (s)", _fmt(result["duration_s"])),
        ("Request throughput (req/s)", _fmt(result["request_throughput"], 3)),
        ("Output token throughput (tok/s)", _fmt(result["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(result["total_token_throughput"])),
        ("Mean prompt tokens", _fmt(result["mean_prompt_tokens"])),
        ("Mean output tokens", _fmt(result["mean_output_tokens"])),
        ("Output tokens counted from", ", ".join(result["output_tokens_from"]) or "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    latency = Table(title="Latency (ms)")
    latency.add_column("metric")
    for key in ("mean", *(f"p{q}" for q in PERCENTILES)):
        latency.add_column(key, justify="right")
    for metric in METRICS:
        values = result[f"{metric}_ms"]
        latency.add_row(metric.upper(), *(_fmt(v) for v in values.values()))
    console = Console()
    console.print(table)
    console.print(latency)
    for error in result["error_samples"]:
        console.print(f"[red]error:[/red] {error}", markup=True, highlight=False)


def main(config: ServeBenchConfig) -> dict[str, Any]:
    result = asyncio.run(run_benchmark(config, progress=True))
    print_report(result)
    if config.result_file:
        Path(config.result_file).write_text(json.dumps(result, indent=2))
    return result


# ----------------------------------------------------------------------------- comparison

_COMPARE_COLUMNS = (
    ("req/s", ("request_throughput",), 3),
    ("out tok/s", ("output_throughput",), 1),
    ("TTFT p50", ("ttft_ms", "p50"), 0),
    ("TTFT p99", ("ttft_ms", "p99"), 0),
    ("TPOT p50", ("tpot_ms", "p50"), 1),
    ("TPOT p99", ("tpot_ms", "p99"), 1),
    ("ITL p50", ("itl_ms", "p50"), 1),
    ("E2E p50", ("e2e_ms", "p50"), 0),
)


def compare_results(paths: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Result files grouped by label (the file name less a `-rN` run suffix): the median of
    each headline metric over runs, and the failed requests of all runs."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(paths):
        label = re.sub(r"-r\d+$", "", Path(path).stem)
        groups.setdefault(label, []).append(json.loads(Path(path).read_text()))
    rows = {}
    for label, runs in groups.items():
        row: dict[str, Any] = {"runs": len(runs), "failed": sum(r["failed"] for r in runs)}
        for name, keys, _ in _COMPARE_COLUMNS:
            values = [v for v in (_dig(r, keys) for r in runs) if v is not None]
            row[name] = statistics.median(values) if values else None
        rows[label] = row
    return rows


def _dig(result: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    value: Any = result
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def print_comparison(paths: Sequence[str], title: str = "Serving comparison") -> None:
    from rich.console import Console
    from rich.table import Table

    rows = compare_results(paths)
    table = Table(title=f"{title} (medians over runs; latencies in ms)")
    for column in ("label", "runs", "failed", *(name for name, _, _ in _COMPARE_COLUMNS)):
        table.add_column(column, justify="left" if column == "label" else "right")
    for label, row in rows.items():
        cells = [_fmt(row[name], digits) for name, _, digits in _COMPARE_COLUMNS]
        table.add_row(label, str(row["runs"]), str(row["failed"]), *cells)
    Console().print(table)
