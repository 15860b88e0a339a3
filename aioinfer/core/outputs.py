"""What generation hands back: vLLM's RequestOutput / CompletionOutput shapes.

The engine streams *deltas*: each RequestOutput holds, per sequence that moved, only the new
text, token ids and logprobs. `OutputAccumulator` folds a stream of deltas into the final
output, which is what the offline LLM and non-streaming HTTP responses return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aioinfer.core.lora import LoRARequest
from aioinfer.core.step import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:  # a method, as vLLM's
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # One entry per prompt token; the first is None (nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # vLLM's: the adapter the offline LLM ran the prompt with; per-request statistics (none
    # here: the engine's are in /metrics and the log).
    lora_request: LoRARequest | None = None
    metrics: Any = None
    # vLLM's fields for what the models here never have (an encoder's prompt, images, K/V sent
    # to another instance): always empty, so that code reading them runs.
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    multi_modal_placeholders: dict[str, Any] = field(default_factory=dict)


@dataclass
class OutputAccumulator:
    """Folds delta RequestOutputs into one complete RequestOutput."""

    n: int
    final: RequestOutput | None = None
    _seqs: dict[int, CompletionOutput] = field(default_factory=dict)

    def add(self, delta: RequestOutput) -> None:
        if self.final is None:
            self.final = RequestOutput(
                delta.request_id, delta.prompt, delta.prompt_token_ids, [], False
            )
        final = self.final
        if delta.prompt_logprobs is not None:
            final.prompt_logprobs = delta.prompt_logprobs
        final.num_cached_tokens = max(final.num_cached_tokens, delta.num_cached_tokens)
        for out in delta.outputs:
            seq = self._seqs.get(out.index)
            if seq is None:
                seq = self._seqs[out.index] = CompletionOutput(
                    out.index, "", [], None, [] if out.logprobs is not None else None
                )
            seq.text += out.text
            seq.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                seq.logprobs = (seq.logprobs or []) + out.logprobs
            seq.cumulative_logprob = out.cumulative_logprob
            seq.finish_reason = out.finish_reason
            seq.stop_reason = out.stop_reason
        final.outputs = [self._seqs[i] for i in sorted(self._seqs)]
        final.finished = delta.finished

    def result(self) -> RequestOutput:
        if self.final is None:
            raise RuntimeError("no output was produced")
        return self.final


@dataclass
class EmbeddingOutput:
    """vLLM's shape: `.embedding` is the vector as a list of floats."""

    data: np.ndarray  # float32, one dimension

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()  # type: ignore[no-any-return]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, and the engine's `encode`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's shape: `.probs` are the class probabilities as a list of floats."""

    data: np.ndarray  # float32, one per label

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()  # type: ignore[no-any-return]


@dataclass
class ClassificationRequestOutput:
    """What `LLM.classify` returns per prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair (vLLM's shape: `.outputs.score`)."""

    request_id: str
    prompt_token_ids: list[int]  # both texts' tokens, the first's then the second's
    outputs: ScoringOutput
    finished: bool = True
