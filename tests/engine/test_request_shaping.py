"""The request shaping that the server and the offline LLM share (engine/request_shaping.py):
truncation, max_tokens fitted to the context where allowed (min_tokens with it), and several
prompts queued all or none."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.model_limits import ModelLimits
from aioinfer.engine.request_shaping import queue_all, shape

LIMITS = ModelLimits(max_model_len=100, vocab_size=1000, max_logprobs=20)


def test_max_tokens_is_lowered_to_the_room_left_only_where_allowed():
    params = SamplingParams(max_tokens=50, min_tokens=45)
    ids, fitted = shape(LIMITS, list(range(60)), params, clamp_max_tokens=True)
    assert len(ids) == 60 and (fitted.max_tokens, fitted.min_tokens) == (40, 40)
    _, kept = shape(LIMITS, list(range(60)), params, clamp_max_tokens=False)
    assert kept is params  # the engine then refuses it, naming both numbers
    _, roomy = shape(LIMITS, list(range(10)), params, clamp_max_tokens=True)
    assert roomy is params
    _, full = shape(LIMITS, list(range(100)), params, clamp_max_tokens=True)
    assert full is params  # no room at all: the engine's error says so


def test_the_prompt_is_truncated_first_and_the_room_counted_after_it():
    params = SamplingParams(max_tokens=80, truncate_prompt_tokens=30)
    ids, fitted = shape(LIMITS, list(range(90)), params, clamp_max_tokens=True)
    assert ids == list(range(60, 90)) and fitted.max_tokens == 70


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[tuple[str, str]] = []

    def abort(self, request_id: str, reason: str) -> None:
        self.aborted.append((request_id, reason))


def test_one_refused_prompt_aborts_those_queued_before_it():
    engine = FakeEngine()

    def add(index: int):
        if index == 2:
            raise ValueError("prompt 2 does not fit")
        return SimpleNamespace(request_id=f"r{index}")

    with pytest.raises(ValueError, match="prompt 2"):
        queue_all(engine, 4, add)  # type: ignore[arg-type]
    assert engine.aborted == [("r0", "rejected"), ("r1", "rejected")]
    streams = queue_all(engine, 2, lambda i: SimpleNamespace(request_id=f"ok{i}"))  # type: ignore[arg-type]
    assert [s.request_id for s in streams] == ["ok0", "ok1"]
