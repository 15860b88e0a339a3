"""The engine's Prometheus series, named like vLLM's with prefix `aioinfer:`; /metrics
serves them (server/metrics.py) and `LLM.get_metrics` reads them (offline/metrics_reader.py).

Everything is read from the engine at scrape time (engine/stats.py), so it also counts work
that did not come through HTTP: gauges, counters, and the histograms the engine observes per
sequence (latencies, phases, token counts) and per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from aioinfer.engine.stats import HOST_PHASES

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine
    from aioinfer.engine.stats import Histogram

PREFIX = "aioinfer:"
METRICS_PREFIXES = ("aioinfer", "vllm")
_LABELS = ("model_name",)
_FINISH_REASONS = ("abort", "length", "stop")  # vLLM's FinishReason
_ABORT_REASONS = ("cancelled", "client_disconnect", "error", "queue_timeout", "rejected",
                  "shutdown", "write_timeout")  # fmt: skip
# vLLM's help texts, by the names in EngineStats.histograms.
_HISTOGRAM_DOCS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
}


class EngineCollector(Collector):
    """Reads the engine's gauges and cumulative counters when scraped. `prefix` names the
    series: "aioinfer" (aioinfer:num_requests_waiting, ...) or "vllm" (vllm:..., the names
    that routers, autoscalers and dashboards built for vLLM read). `lora_names`: False puts
    adapter-<slot> where lora_requests_info names an adapter (the route needs no key)."""

    def __init__(
        self,
        get_engine: Callable[[], AsyncEngine | None],
        prefix: str = "aioinfer",
        lora_names: bool = True,
    ) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self._get_engine = get_engine
        self._prefix = prefix + ":"
        self._lora_names = lora_names

    def collect(self) -> Iterator[Metric]:
        if self._prefix == PREFIX:
            yield from self._collect()
            return
        for family in self._collect():
            yield _renamed(family, self._prefix)

    def _collect(self) -> Iterator[Metric]:
        engine = self._get_engine()
        if engine is None or engine.scheduler is None:
            return
        name = [engine.model_name]
        scheduler = engine.scheduler
        kv = scheduler.kv
        gauges = {
            "num_requests_running": ("Requests in the running batch.", scheduler.num_running),
            "num_requests_waiting": ("Requests waiting to run.", scheduler.num_waiting),
            "kv_cache_usage_perc": ("KV-cache usage; 1 means 100 percent.", kv.usage),
        }
        for metric, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(PREFIX + metric, doc, labels=_LABELS)
            gauge.add_metric(name, float(value))
            yield gauge
        counters = {
            "prompt_tokens": ("Prompt tokens prefilled.", engine.stats.prompt_tokens),
            "generation_tokens": ("Tokens generated.", engine.stats.generation_tokens),
            "prefix_cache_queries": ("Prompt tokens looked up in the cache.", kv.stats.queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", kv.stats.hits),
            "num_preemptions": ("Preemptions of running requests.", scheduler.num_preemptions),
        }  # fmt: skip
        if scheduler.speculation is not None:
            spec = scheduler.spec_stats
            counters |= {
                "spec_decode_num_drafts": ("Steps that checked drafted tokens.", spec.num_drafts),
                "spec_decode_num_draft_tokens": ("Drafted tokens.", spec.num_draft_tokens),
                "spec_decode_num_accepted_tokens": (
                    "Drafted tokens accepted.",
                    spec.num_accepted_tokens,
                ),
            }
        for metric, (doc, value) in counters.items():
            counter = CounterMetricFamily(PREFIX + metric, doc, labels=_LABELS)
            counter.add_metric(name, float(value))
            yield counter
        yield _by_reason(
            "request_success",
            "Finished requests by finish reason.",
            name,
            engine.stats.finished,
            _FINISH_REASONS,
            label="finished_reason",
        )
        if scheduler.speculation is not None:
            per_position = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Drafted tokens accepted, by position in the draft.",
                labels=(*_LABELS, "position"),
            )
            for position, count in enumerate(scheduler.spec_stats.accepted_per_position):
                per_position.add_metric([*name, str(position)], float(count))
            yield per_position
        host = CounterMetricFamily(
            PREFIX + "host_seconds",
            "Host seconds spent on the per-token path, by phase (see engine/stats.py).",
            labels=(*_LABELS, "phase"),
        )
        for phase, seconds in host_seconds(engine).items():
            host.add_metric([*name, phase], seconds)
        yield host
        for metric, histogram in engine.stats.histograms.items():
            yield _histogram(metric, _HISTOGRAM_DOCS[metric], name, histogram)
        if engine.model_config.enable_lora:
            yield _lora_info(engine, self._lora_names)
        yield _cache_config_info(engine)
        yield _by_reason(
            "request_aborted",
            "Requests ended early (once each), by reason: client_disconnect, write_timeout, "
            "queue_timeout, shutdown, cancelled, error, rejected.",
            name,
            engine.stats.aborted_by_reason,
            _ABORT_REASONS,
        )
        yield _by_reason(
            "request_rejected",
            "Requests refused at admission, by reason (queue_full).",
            name,
            engine.stats.rejected,
            ("queue_full",),
        )


def _lora_info(engine: AsyncEngine, named: bool = True) -> GaugeMetricFamily:
    """vLLM's `lora_requests_info`: the adapters of the running and the waiting requests as
    labels (names joined by commas; without `named`, adapter-<slot> for each), its value the
    time of the scrape."""
    scheduler = engine.scheduler
    assert scheduler is not None
    slots = engine.loras.slots
    if not named:
        slots = {f"adapter-{slot}": slot for slot in slots.values()}
    running = adapters_of(slots, scheduler.running)
    waiting = adapters_of(slots, scheduler.waiting)
    info = GaugeMetricFamily(
        PREFIX + "lora_requests_info",
        "Running stats on LoRA requests.",
        labels=("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
    )
    labels = [str(engine.model_config.max_loras), ",".join(waiting), ",".join(running)]
    info.add_metric(labels, time.time())
    return info


def adapters_of(slots: dict[str, int], requests: Iterable[Any]) -> list[str]:
    """The names of the adapters (`slots`: name -> slot) that `requests` run with, sorted."""
    names = {slot: name for name, slot in slots.items()}
    return sorted({names[r.lora_slot] for r in requests if r.lora_slot in names})


def _by_reason(
    metric: str,
    doc: str,
    name: list[str],
    counts: dict[str, int],
    known: tuple[str, ...],
    label: str = "reason",
) -> CounterMetricFamily:
    """A counter by reason: the `known` reasons are there from the start, at zero, as vLLM
    creates its series (a rate over a series that appears late misses its first events)."""
    counter = CounterMetricFamily(PREFIX + metric, doc, labels=(*_LABELS, label))
    for reason in sorted(set(known) | set(counts)):
        counter.add_metric([*name, reason], float(counts.get(reason, 0)))
    return counter


def _histogram(
    metric: str, doc: str, name: list[str], histogram: Histogram
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + metric, doc, labels=_LABELS)
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip((*histogram.buckets, float("inf")), histogram.counts, strict=True):
        total += count  # Prometheus' buckets are cumulative
        buckets.append((floatToGoString(bound), float(total)))
    family.add_metric(name, buckets, histogram.sum)
    return family


def _cache_config_info(engine: AsyncEngine) -> GaugeMetricFamily:
    """vLLM's cache_config_info: the cache's settings as labels of a gauge at 1."""
    config = engine.cache_config
    info = {
        "block_size": config.block_size,
        "cache_dtype": "auto",
        "enable_prefix_caching": config.enable_prefix_caching,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "num_gpu_blocks": engine.scheduler.kv.pool.num_blocks if engine.scheduler else None,
        "num_gpu_blocks_override": config.num_gpu_blocks_override,
    }
    gauge = GaugeMetricFamily(
        PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
    )
    gauge.add_metric([str(v) for v in info.values()], 1.0)
    return gauge


def host_seconds(engine: AsyncEngine) -> dict[str, float]:
    """Seconds per phase of the per-token path (HOST_PHASES), each phase counted once: the GPU
    thread's launch without its prepare, the loop's apply without its detokenize."""
    loop = engine.stats.host_seconds
    runner = getattr(engine.gpu.runner, "host_seconds", None) or {}
    detokenize = engine.scheduler.detokenize_seconds if engine.scheduler is not None else 0.0
    own = {
        "prepare": runner.get("prepare", 0.0),
        "launch": runner.get("launch", 0.0) - runner.get("prepare", 0.0),
        "finish": runner.get("finish", 0.0),
        "apply": loop.get("apply", 0.0) - detokenize,
        "detokenize": detokenize,
    }
    return {phase: own.get(phase, loop.get(phase, 0.0)) for phase in HOST_PHASES}


def _renamed(family: Metric, prefix: str) -> Metric:
    """The family and its samples under `prefix` instead of PREFIX."""
    family.name = prefix + family.name.removeprefix(PREFIX)
    family.samples = [
        sample._replace(name=prefix + sample.name.removeprefix(PREFIX)) for sample in family.samples
    ]
    return family
