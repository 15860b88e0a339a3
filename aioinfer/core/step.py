"""The plain-data contract between the scheduler (event loop) and the model runner (GPU thread).

A StepPlan is built by `Scheduler.schedule()` and never mutated afterwards; the GPU thread reads it
while the loop goes on. A StepResult comes back and is applied by `Scheduler.apply()`.

Positions of one request's chunk, with block size 4 and a chunk that starts at position 6:

    block_table   [ 7 ][ 2 ][ 9 ]          logical block i holds positions 4i .. 4i+3
    positions      6 7 | 8 9 10            token at position p goes to slot
    slots         30 31| 8 9 10            block_table[p // 4] * 4 + p % 4
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aioinfer.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from aioinfer.core.constraints import TokenConstraints


# The stand-in for a token sampled by the step in flight (ScheduledChunk.previous_token).
PENDING_TOKEN = 0


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a step."""

    request_id: str
    # Tokens fed this step, for positions start_pos .. start_pos + len - 1.
    token_ids: tuple[int, ...]
    # Position of token_ids[0]; equals the request's num_computed_tokens before this step.
    start_pos: int
    # Every KV block of the request, logical order; covers start_pos + len(token_ids) tokens.
    block_table: tuple[int, ...]
    # Whether a token is sampled from the logits of the last fed token (decode, or the last
    # chunk of a prefill).
    sample: bool
    sampling_params: SamplingParams
    # How many output tokens the request had before this step: the seeded-sampling key, so a
    # seeded request draws the same noise whatever batch it is in.
    output_index: int = 0
    # Prompt + output ids so far; set only when penalties need them.
    history: tuple[int, ...] | None = None
    # Number of prompt tokens (penalties treat prompt and output differently).
    prompt_len: int = 0
    # Token ids the sampler must not pick this step (EOS and stop ids before min_tokens).
    banned_token_ids: tuple[int, ...] = ()
    # What limits the sampled token beyond the bans (allowed_token_ids, a grammar): the sampler
    # asks it for the bitmask on the runner thread, where a grammar's work holds up neither
    # the event loop nor, on a GPU, the forward pass. Nothing else touches it until apply().
    constraints: TokenConstraints | None = None
    # When prompt logprobs are asked for: the prompt token that follows each fed token, i.e.
    # prompt[start_pos + 1 : start_pos + len + 1] (one shorter on the last prefill chunk).
    prompt_logprob_targets: tuple[int, ...] | None = None
    # Speculative tokens fed after the request's last token (the tail of token_ids): a token is
    # sampled at each of their positions too, and the runner keeps those that verify (see
    # core/spec_decode.py). Only with sample=True. The sampler samples one row per chunk,
    # after history + draft_token_ids: the runner gives it one chunk per position, each with
    # the drafts before that position (draft_rows).
    draft_token_ids: tuple[int, ...] = ()
    # An embedding request's pooling type (core/pooling.py): the runner hands back what it
    # needs of this chunk's hidden states. Such a chunk never samples.
    pooling: str | None = None
    # The LoRA adapter applied to this chunk's tokens (its slot in the runner; 0: none).
    lora_slot: int = 0
    # Whether the tokens turn with LongRoPE's long factors: the request is longer than the
    # model's original context (core/scheduler.py).
    long_rope: bool = False
    # Whether token_ids[-1] is a stand-in (PENDING_TOKEN) for the token this request samples
    # in the step before, still running when this one was planned: the runner takes it from
    # that step's output, on the device.
    previous_token: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def positions(self) -> list[int]:
        return list(range(self.start_pos, self.start_pos + len(self.token_ids)))

    def slot_mapping(self, block_size: int) -> list[int]:
        return [
            self.block_table[p // block_size] * block_size + p % block_size
            for p in self.positions()
        ]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the runner needs for one forward pass."""

    step_id: int
    chunks: tuple[ScheduledChunk, ...]
    # Requests that finished or were aborted since the last plan: per-request runner state
    # (seeded generators, penalty buffers) may be dropped.
    finished_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's per-token entry: the log-probability, its rank (1 = most likely) and the text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class TokenLogprobs(Mapping[int, Logprob]):
    """Log-probability of one chosen token and the most likely alternatives at its position.

    It is also the `{token_id: Logprob}` dict that vLLM hands out per position (the chosen token
    first, then the alternatives), so scripts written for vLLM read it unchanged; the offline
    LLM fills `decoded` for each entry's `decoded_token`.
    """

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()  # the N most likely (token id, logprob), best first
    decoded: Mapping[int, str] | None = field(default=None, compare=False)

    def __getitem__(self, token_id: int) -> Logprob:
        text = self.decoded.get(token_id) if self.decoded is not None else None
        if token_id == self.token_id:
            return Logprob(self.logprob, self.rank, text)
        for rank, (top_id, logprob) in enumerate(self.top, start=1):
            if top_id == token_id:
                return Logprob(logprob, rank, text)
        raise KeyError(token_id)

    def __iter__(self) -> Iterator[int]:
        yield self.token_id
        for top_id, _ in self.top:
            if top_id != self.token_id:
                yield top_id

    def __len__(self) -> int:
        return 1 + sum(1 for top_id, _ in self.top if top_id != self.token_id)

    def _key(self) -> tuple[int, float, int, tuple[tuple[int, float], ...]]:
        return self.token_id, self.logprob, self.rank, self.top

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenLogprobs):
            return self._key() == other._key()  # the decoded texts aside
        if isinstance(other, Mapping):
            return dict(self) == dict(other)  # a vLLM {token_id: Logprob} dict
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return repr(dict(self))  # printed as vLLM's dict


@dataclass(slots=True)
class StepResult:
    """What the runner hands back for one StepPlan."""

    step_id: int
    # Per chunk with sample=True, the tokens it emits: one, or with drafts the accepted drafts
    # and the token sampled after them.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request that asked for logprobs: one entry per emitted token.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per request that asked for prompt logprobs: one entry per prompt_logprob_targets token.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per chunk with a pooling type, its part (core/pooling.fold): a float32 numpy vector, or
    # nothing where the chunk holds none of what the type reads.
    pooled: dict[str, Any] = field(default_factory=dict)
