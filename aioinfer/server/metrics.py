"""Prometheus metrics, one CollectorRegistry per app, named like vLLM's with prefix `aioinfer:`.

Engine-wide numbers (queue sizes, KV usage, token and prefix-cache counters, finished requests)
are read from the engine at scrape time, so they also count work that did not come through HTTP.
Latencies are observed by the HTTP layer, per request, as outputs arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aioinfer.core.outputs import RequestOutput

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine

PREFIX = "aioinfer:"
_LABELS = ("model_name",)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineCollector(Collector):
    """Reads the engine's gauges and cumulative counters when scraped."""

    def __init__(self, get_engine: Callable[[], AsyncEngine | None]) -> None:
        self._get_engine = get_engine

    def collect(self) -> Iterator[Metric]:
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
        finished = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            labels=(*_LABELS, "finished_reason"),
        )
        for reason, count in sorted(engine.stats.finished.items()):
            finished.add_metric([*name, reason], float(count))
        yield finished
        if scheduler.speculation is not None:
            per_position = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Drafted tokens accepted, by position in the draft.",
                labels=(*_LABELS, "position"),
            )
            for position, count in enumerate(scheduler.spec_stats.accepted_per_position):
                per_position.add_metric([*name, str(position)], float(count))
            yield per_position
        if engine.model_config.enable_lora:
            yield _lora_info(engine)
        yield _by_reason(
            "request_aborted",
            "Requests ended early (once each), by reason: client_disconnect, write_timeout, "
            "queue_timeout, shutdown, cancelled, error, rejected.",
            name,
            engine.stats.aborted_by_reason,
        )
        yield _by_reason(
            "request_rejected",
            "Requests refused at admission, by reason (queue_full).",
            name,
            engine.stats.rejected,
        )


def _lora_info(engine: AsyncEngine) -> GaugeMetricFamily:
    """vLLM's `lora_requests_info`: the adapters of the running and the waiting requests as
    labels (names joined by commas), its value the time of the scrape."""
    scheduler = engine.scheduler
    assert scheduler is not None
    running = adapters_of(engine.loras.slots, scheduler.running)
    waiting = adapters_of(engine.loras.slots, scheduler.waiting)
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
    metric: str, doc: str, name: list[str], counts: dict[str, int]
) -> CounterMetricFamily:
    counter = CounterMetricFamily(PREFIX + metric, doc, labels=(*_LABELS, "reason"))
    for reason, count in sorted(counts.items()):
        counter.add_metric([*name, reason], float(count))
    return counter


class ServerMetrics:
    """The registry of one app, its latency histograms and the engine collector."""

    def __init__(self, get_engine: Callable[[], AsyncEngine | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine))
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Time from admission to the first output token.",
            _TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL_BUCKETS
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Time from admission to the last output token.",
            _E2E_BUCKETS,
        )

    def _histogram(self, metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + metric, doc, _LABELS, buckets=buckets, registry=self.registry)

    def timer(self, model_name: str) -> RequestTimer:
        return RequestTimer(self, model_name)


class RequestTimer:
    """Latencies of one engine request, fed with its output deltas."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self._ttft = metrics.ttft.labels(model_name)
        self._itl = metrics.itl.labels(model_name)
        self._e2e = metrics.e2e.labels(model_name)
        self.start = time.perf_counter()
        self._last: float | None = None

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        # A delta's tokens (several steps' when the reader lagged, or one step's accepted
        # drafts) share the gap since the last one, a token each.
        steps = max((len(seq.token_ids) for seq in output.outputs), default=0)
        if steps:
            if self._last is None:
                self._ttft.observe(now - self.start)
            else:
                gap = (now - self._last) / steps
                for _ in range(steps):
                    self._itl.observe(gap)
            self._last = now
        if output.finished and self._last is not None:
            self._e2e.observe(now - self.start)

    def finished(self) -> None:
        """A request that outputs no tokens (an embedding) is done: its end-to-end latency."""
        self._e2e.observe(time.perf_counter() - self.start)
