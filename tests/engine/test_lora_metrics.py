"""vLLM's lora_requests_info names the adapters of the running and the waiting requests."""

from __future__ import annotations

from types import SimpleNamespace

from aioinfer.engine.metrics import adapters_of


def test_the_adapters_of_requests_are_named_once_and_sorted():
    slots = {"second": 2, "first": 1, "idle": 3}
    requests = [SimpleNamespace(lora_slot=s) for s in (2, 0, 1, 2, 7)]  # 0: base; 7: unloaded
    assert adapters_of(slots, requests) == ["first", "second"]
    assert adapters_of(slots, []) == []
