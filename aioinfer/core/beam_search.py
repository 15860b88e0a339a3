"""Beam search's pure part, as vLLM's `LLM.beam_search` defines it: the parameters, a beam,
the result, the score that ranks beams, and one step of the search.

Each step extends every live beam by its 2 x beam_width most likely tokens; a candidate that
ends in an end-of-sequence token is finished, the others compete for the beam_width places.
Beams rank by cumulative logprob / length ** length_penalty, the length counting the prompt
and leaving out a final end-of-sequence token (vLLM's `get_beam_search_score`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aioinfer.core.step import Logprob


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    # vLLM's field, read by nothing here: as in vLLM's offline search, a beam's text is all
    # its tokens decoded, an end-of-sequence token included.
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens and those generated after them, with the logprobs of
    each generated position ({token_id: Logprob}, the candidates that step saw)."""

    tokens: list[int]
    logprobs: list[Mapping[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # the whole sequence decoded, the prompt included (as vLLM's)
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"
    stop_reason: int | None = None  # the end-of-sequence token that finished it
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    """The best beam_width beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(
    beam: BeamSearchSequence, eos_token_ids: Iterable[int], length_penalty: float
) -> float:
    length = len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in set(eos_token_ids):
        length -= 1
    return beam.cum_logprob / (length**length_penalty)


@dataclass
class BeamSearchInstance:
    """One prompt's search: the live beams and the finished ones."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)

    def extend(
        self,
        candidates: Sequence[Mapping[int, Logprob]],
        params: BeamSearchParams,
        eos_token_ids: frozenset[int],
        max_len: int,
    ) -> None:
        """One step: `candidates[i]` are the next tokens of live beam i, with their logprobs.
        A beam that reaches `max_len` tokens (the context) finishes with "length"."""
        grown: list[BeamSearchSequence] = []
        for beam, position in zip(self.beams, candidates, strict=True):
            for token_id, entry in position.items():
                new = BeamSearchSequence(
                    [*beam.tokens, token_id],
                    [*beam.logprobs, position],
                    beam.cum_logprob + entry.logprob,
                    lora_request=beam.lora_request,
                )
                if token_id in eos_token_ids and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    self.completed.append(new)
                else:
                    grown.append(new)
        grown.sort(key=lambda b: beam_score(b, eos_token_ids, params.length_penalty), reverse=True)
        self.beams = []
        for beam in grown[: params.beam_width]:
            if len(beam.tokens) >= max_len:
                beam.finish_reason = "length"
                self.completed.append(beam)
            else:
                self.beams.append(beam)

    def best(
        self, params: BeamSearchParams, eos_token_ids: frozenset[int]
    ) -> list[BeamSearchSequence]:
        """The best beam_width of the finished beams and those still live (max_tokens ran
        out: "length")."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(
            self.completed + self.beams,
            key=lambda b: beam_score(b, eos_token_ids, params.length_penalty),
            reverse=True,
        )
        return ranked[: params.beam_width]
