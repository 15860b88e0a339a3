"""Prometheus metrics, one CollectorRegistry per app: the engine's series
(engine/metrics.py) and the process series that vLLM's default registry exports."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from aioinfer.engine.metrics import EngineCollector

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


class ServerMetrics:
    """The registry of one app, over the engine collector."""

    def __init__(
        self,
        get_engine: Callable[[], AsyncEngine | None],
        prefix: str = "aioinfer",
        lora_names: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_engine, prefix, lora_names))
        # process_*, python_gc_* and python_info, as the default registry that vLLM's metrics
        # live in exports them.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
