"""The engine's counters, which /metrics and the periodic log line read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters the metrics endpoint and the periodic log line read."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    aborted: int = 0  # requests (not sequences) that ended early, all reasons together
    aborted_by_reason: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)  # refused at admission, by reason

    @staticmethod
    def count(counter: dict[str, int], key: str) -> None:
        counter[key] = counter.get(key, 0) + 1
