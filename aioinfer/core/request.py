"""One request's state as the scheduler sees it."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import TokenLogprobs

if TYPE_CHECKING:
    import numpy as np

    from aioinfer.core.block_pool import BlockHash
    from aioinfer.core.constraints import TokenConstraints
    from aioinfer.core.detokenizer import IncrementalDetokenizer
    from aioinfer.core.pooling import PoolerConfig

# vLLM's bound on a cache_salt: a salt is hashed into each new block's key.
MAX_CACHE_SALT_CHARS = 1024


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class TokenIds(Sequence[int]):
    """A sequence's tokens, its prompt's then its output's, without a copy of either: the
    prompt is a tuple that the n sequences of one request share, the output the sequence's own
    list. A slice is a tuple."""

    __slots__ = ("output", "prompt")

    def __init__(self, prompt: tuple[int, ...], output: list[int]) -> None:
        self.prompt = prompt
        self.output = output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.prompt, self.output)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        prompt, num_prompt = self.prompt, len(self.prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return tuple(self)[index]
            if stop <= num_prompt:
                return prompt[start:stop]
            output = tuple(self.output[max(start - num_prompt, 0) : stop - num_prompt])
            return prompt[start:] + output if start < num_prompt else output
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return prompt[index] if index < num_prompt else self.output[index - num_prompt]


class Request:
    """Prompt, outputs and progress of one sequence.

    `num_computed_tokens` is the one progress counter: the tokens whose K/V are in the cache
    (or are being written by the step in flight). Tokens `num_computed_tokens ..
    num_tokens - 1` still have to be fed.

    A prompt given as a tuple is kept as it is, not copied: the n sequences of one request
    share it (a long prompt with a large n once cost 16 bytes a token a sequence).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        detokenizer: IncrementalDetokenizer | None = None,
        constraints: TokenConstraints | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        pooler: PoolerConfig | None = None,
        lora_slot: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None here
        self.eos_token_ids = eos_token_ids
        self.detokenizer = detokenizer
        self.constraints = constraints
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # For the metrics (time.monotonic()): when first scheduled, when the first and the
        # latest output came out. Preemption changes none of them.
        self.scheduled_time = 0.0
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.priority = priority  # with the priority policy: lower runs first
        # Set for an embedding request: its prompt is prefilled, pooled and never decoded.
        self.pooler = pooler
        self.pooled: np.ndarray | None = None  # the parts its chunks handed back, folded
        # The LoRA adapter the forward passes apply (its slot in the runner; 0: none).
        self.lora_slot = lora_slot
        # vLLM's cache_salt: prefixes are shared only among requests of the same salt.
        self.cache_salt = cache_salt
        # Set once the request is longer than a LongRoPE model's original context: from then
        # on all its tokens turn with the long factors (core/scheduler.py).
        self.long_rope = False
        self.output_token_ids: list[int] = []
        self.all_token_ids = TokenIds(self.prompt_token_ids, self.output_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by a step in flight and not appended yet: with steps overlapped, the
        # next step is planned while the last one runs (core/scheduler.py).
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache on admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        self.block_hashes: list[BlockHash] = []  # hashes of this request's full blocks, in order
        # Looked up for every token: a set, however long the client's list.
        self._stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        banned = set(self._stop_token_ids)
        if not sampling_params.ignore_eos:
            banned |= self.eos_token_ids
        self._banned_before_min_tokens = tuple(sorted(banned))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether every prompt token must be computed here: for its prompt logprobs, for a
        pooling that reads every token's hidden state, or as its sampling params ask."""
        return (
            self.wants_prompt_logprobs
            or bool(self.sampling_params.skip_reading_prefix_cache)
            or (self.pooler is not None and self.pooler.reads_every_token)
        )

    @property
    def can_speculate(self) -> bool:
        """Whether drafted tokens may be checked in this step: a grammar's mask (and a bad
        word's ban) depends on the tokens before it, and before min_tokens the bans move with
        each token, so those requests decode one token at a time."""
        return (
            self.pooler is None
            and self.constraints is None
            and self.num_output_tokens >= self.sampling_params.min_tokens
        )

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)  # and so to all_token_ids
        if self.constraints is not None:
            self.constraints.accept(token_id)

    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the sampler must skip: those that would stop the request before min_tokens,
        and the ends of bad words (a mask that allows nothing else overrides them, see
        core/constraints.py)."""
        # A grammar held back while the model reasons: the output may not end before the
        # answer it constrains (max_tokens still can).
        awaits_answer = self.constraints is not None and self.constraints.awaits_answer
        num_output = self.num_output_tokens + self.num_pending_tokens
        if num_output >= self.sampling_params.min_tokens and not awaits_answer:
            before_min: tuple[int, ...] = ()
        else:
            before_min = self._banned_before_min_tokens
        if self.constraints is None:
            return before_min
        return self.constraints.banned(self.output_token_ids, before_min)

    def is_stop_token(self, token_id: int) -> bool:
        """Whether the just appended `token_id` ends the request: EOS or one of stop_token_ids,
        once min_tokens are out."""
        params = self.sampling_params
        if self.num_output_tokens < params.min_tokens:
            return False
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return True
        return token_id in self._stop_token_ids

    def check_stop(
        self, token_id: int, stop_token: bool, stop_string: str | None
    ) -> RequestStatus | None:
        """The finishing status after `token_id` was appended (`stop_token`: what
        `is_stop_token` said of it), or None to go on."""
        params = self.sampling_params
        if self.constraints is not None and self.constraints.grammar_done and not stop_token:
            return RequestStatus.FINISHED_STOPPED
        if stop_token:
            if params.ignore_eos or token_id not in self.eos_token_ids:
                self.stop_reason = token_id  # one of stop_token_ids; EOS leaves stop_reason None
            return RequestStatus.FINISHED_STOPPED
        if stop_string is not None and self.num_output_tokens >= params.min_tokens:
            self.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def never_started(request: Request | None) -> bool:
    """Waiting for its first step: nothing computed, nothing produced, never preempted."""
    return (
        request is not None
        and request.num_computed_tokens == 0
        and request.num_preemptions == 0
        and request.num_output_tokens == 0
    )
