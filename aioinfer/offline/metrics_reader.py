"""`LLM.get_metrics()`: the engine's series, the ones /metrics serves, as plain values in the
shapes of vLLM's `vllm.v1.metrics.reader`: a Counter, Gauge or Histogram per series (a name and
its labels), and a Vector for the counters kept per draft position."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """Counters indexed by their `position` label, which the labels here leave out."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # cumulative counts by upper bound, as Prometheus writes it


def read_metrics(collector: Collector) -> list[Metric]:
    """What `collector` reports now, one entry per series (a family and its labels)."""
    metrics: list[Metric] = []
    for family in collector.collect():
        samples = family.samples
        if family.type == "gauge":
            metrics += [Gauge(family.name, s.labels, s.value) for s in samples]
        elif family.type == "counter" and family.name.endswith("_per_pos"):
            metrics += _vectors(family.name, _named(samples, family.name + "_total"))
        elif family.type == "counter":
            totals = _named(samples, family.name + "_total")
            metrics += [Counter(family.name, s.labels, int(s.value)) for s in totals]
        elif family.type == "histogram":
            metrics += _histograms(family.name, samples)
    return metrics


def _named(samples: Iterable[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def _without(labels: dict[str, str], name: str) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in labels.items() if k != name)


def _vectors(name: str, samples: list[Sample]) -> list[Metric]:
    by_series: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
    for s in samples:
        counts = by_series.setdefault(_without(s.labels, "position"), {})
        counts[int(s.labels["position"])] = int(s.value)
    return [
        Vector(name, dict(labels), [counts.get(i, 0) for i in range(max(counts, default=-1) + 1)])
        for labels, counts in by_series.items()
    ]


def _histograms(name: str, samples: list[Sample]) -> list[Metric]:
    series: dict[tuple[tuple[str, str], ...], Histogram] = {}

    def of(labels: dict[str, str]) -> Histogram:
        key = _without(labels, "le")
        return series.setdefault(key, Histogram(name, dict(key), 0, 0.0, {}))

    for s in samples:
        if s.name == name + "_bucket":
            of(s.labels).buckets[s.labels["le"]] = int(s.value)
        elif s.name == name + "_count":
            of(s.labels).count = int(s.value)
        elif s.name == name + "_sum":
            of(s.labels).sum = s.value
    return list(series.values())
