"""Scheduling policy: which tokens of which requests go into the next step.

Continuous batching with a token budget per step (`max_num_batched_tokens`) and a cap on
requests per step (`max_num_seqs`). Running requests are served first (one decode token each,
or their next prefill chunk), then waiting ones in arrival order, after prefix-cache hits. When
the pool runs out of blocks the newest running request is preempted: its blocks are freed and it
waits at the front of the queue to recompute from its prefix.

With the priority policy, the waiting queue is ordered by (priority, arrival) instead (lower
first; a preempted request goes back to its place), running requests take their shares in that
order too, and so the victim is always the running request with the largest (priority, arrival).

A LongRoPE model (Phi-3) turns a sequence within its original context with its short factors
and one past it with its long factors, all of its tokens (transformers recomputes the cache of
a sequence that grows past it). So a request longer than `longrope_original` tokens is marked
`long_rope` before it is first scheduled, and one that grows past it while running is
computed again from its first token, once, with the long factors.

An embedding request (one with a pooler) is only prefilled: its chunks hand back pooled parts
instead of sampling, and it finishes when its prompt is done.

A request's `num_computed_tokens` advances when its tokens are scheduled; `apply()` appends what
was sampled. `schedule()` and `apply()` alternate, or, with steps overlapped, the next plan is
built while a step runs (when `can_plan_ahead` allows it), and its result applied after:

    schedule(N) | schedule(N+1) apply(N) | schedule(N+2) apply(N+1) | ...

A request that samples in step N then has a pending token (`num_pending_tokens`): step N+1 feeds
it as a stand-in that the runner takes from N's output on the device. Requests whose next step
depends on that token's value on the host (a grammar's mask, penalties over the history,
drafts) make the loop wait for N instead. A request that N finishes (a stop, max_tokens) may
run once more in N+1; apply() drops what it samples there.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from aioinfer.config import NgramSpeculation
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.pooling import fold
from aioinfer.core.request import Request, RequestStatus
from aioinfer.core.spec_decode import NgramProposer, SpecDecodeStats
from aioinfer.core.step import (
    PENDING_TOKEN,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class PriorityQueue:
    """The waiting queue of the priority policy, with the deque methods the scheduler uses:
    kept sorted by (priority, arrival), a binary search and a list insert per request. A
    preempted request (appendleft) goes back to its place, like any other."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float]] = []
        self._items: list[Request] = []

    def append(self, request: Request) -> None:
        key = _priority_key(request)
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._items.insert(index, request)

    appendleft = append

    def popleft(self) -> Request:
        del self._keys[0]
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        index = self._items.index(request)
        del self._keys[index], self._items[index]

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


@dataclass
class RequestUpdate:
    """What one step changed for one request: the event the engine fans out."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_delta: str = ""
    finished: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_usage: float = 0.0


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculation: NgramSpeculation | None = None,
        policy: str = "fcfs",
        longrope_original: int | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs} and "
                f"{max_num_batched_tokens}"
            )
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        self.kv = kv
        self.policy = policy
        self.longrope_original = longrope_original
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] | PriorityQueue = (
            PriorityQueue() if policy == "priority" else deque()
        )
        # Admission order (by priority under that policy): the last one is preempted first.
        self.running: list[Request] = []
        # The prompt tokens of the waiting requests, which admission control bounds.
        self.num_waiting_tokens = 0
        self.num_preemptions = 0
        self._step_id = 0
        self._finished_since_last_plan: list[str] = []
        self.speculation = speculation
        self.proposer = NgramProposer(speculation) if speculation is not None else None
        self.spec_stats = SpecDecodeStats()
        self.detokenize_seconds = 0.0  # of apply()'s time (the host-overhead metrics read it)

    # ----------------------------------------------------------------- queue management

    def check_priority(self, priority: int) -> None:
        """ValueError for a priority this scheduler cannot order by."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.policy != "priority":
            raise ValueError(
                f"priority is only used with --scheduling-policy priority, got {priority}"
            )

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.waiting.append(request)  # first: a queue that refuses it leaves nothing behind
        self.requests[request.request_id] = request
        self.num_waiting_tokens += request.num_prompt_tokens

    def abort(self, request_id: str) -> Request | None:
        """Finish a request in any state and free its blocks at once. Idempotent: returns the
        request the first time, None when it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
            self.num_waiting_tokens -= request.num_prompt_tokens
        else:
            self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_usage=self.kv.usage,
        )

    # ----------------------------------------------------------------- building a step

    def schedule(self) -> StepPlan:
        """Spend the step's token budget. Mutates request progress, queues and block tables."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        budget, preempted = self._schedule_running(budget, chunks)
        if not preempted:
            self._schedule_waiting(budget, chunks)
        self._step_id += 1
        finished, self._finished_since_last_plan = self._finished_since_last_plan, []
        return StepPlan(self._step_id, tuple(chunks), tuple(finished))

    def _schedule_running(self, budget: int, chunks: list[ScheduledChunk]) -> tuple[int, bool]:
        if self.policy == "priority":
            # Smallest key first: whoever runs short of blocks, the victim (the last) has a
            # larger key than every request already given its share of the step.
            self.running.sort(key=_priority_key)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self._passes_original_context(request):
                self.kv.free(request)  # before its hashes change: its blocks stay cached
                request.num_computed_tokens = 0
                self._mark_long_rope(request)
            num_left = request.num_tokens + request.num_pending_tokens - request.num_computed_tokens
            if num_left <= 0 or self._ends_in_flight(request):
                i += 1  # planned ahead: the step in flight is its last, or its prompt's last
                continue
            num_new = min(num_left, budget)
            drafts = self._drafts(request, budget - num_new) if num_new == 1 else ()
            if drafts and self.kv.allocate(request, num_new + len(drafts)) is not None:
                chunks.append(self._make_chunk(request, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1
                continue
            while self.kv.allocate(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chunks.append(self._make_chunk(request, num_new))
                budget -= num_new
                i += 1
        return budget, preempted

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._passes_original_context(request):
                self._mark_long_rope(request)
            cached_blocks, num_hit = self.kv.find_cached_prefix(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if self.kv.allocate(request, num_new, cached_blocks) is None:
                break
            self.waiting.popleft()
            self.num_waiting_tokens -= request.num_prompt_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
                request.scheduled_time = time.monotonic()
                # As vLLM's counters: lookups made, not skipped ones; a preempted request
                # finding its own blocks again would inflate the hits.
                if self.kv.uses_prefix_cache(request):
                    self.kv.stats.record(request.num_tokens, num_hit)
            self.running.append(request)
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new

    def _drafts(self, request: Request, room: int) -> tuple[int, ...]:
        """Speculative tokens for a decoding request, within `room` more tokens of budget."""
        if self.proposer is None or room <= 0 or not request.can_speculate:
            return ()
        busy = self.proposer.spec.disable_by_batch_size
        if busy is not None and len(self.running) >= busy:
            return ()
        # A draft past max_tokens could never be emitted.
        room = min(room, request.max_tokens - request.num_output_tokens - 1)
        if self.longrope_original is not None and not request.long_rope:
            # Drafts past the original context would be checked with the wrong factors.
            room = min(room, self.longrope_original - request.num_tokens)
        return self.proposer.propose(request.request_id, request.all_token_ids, room)

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the token the step in flight samples for `request` is its last."""
        pending = request.num_pending_tokens
        return pending > 0 and request.num_output_tokens + pending >= request.max_tokens

    def _make_chunk(
        self, request: Request, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        # Drafts are computed too until apply() learns how many were accepted.
        request.num_computed_tokens = end + len(drafts)
        params = request.sampling_params
        pooler = request.pooler
        token_ids = tuple(request.all_token_ids[start:end])
        previous_token = len(token_ids) < num_new  # sampled by the step in flight
        if previous_token:
            token_ids += (PENDING_TOKEN,)
        output_index = request.num_output_tokens + request.num_pending_tokens
        sample = end == request.num_tokens + request.num_pending_tokens and pooler is None
        if sample:
            request.num_pending_tokens += 1
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids + drafts,
            start_pos=start,
            block_table=tuple(self.kv.block_table(request.request_id)),
            sample=sample,
            sampling_params=params,
            output_index=output_index,
            history=tuple(request.all_token_ids) if params.has_penalties else None,
            prompt_len=request.num_prompt_tokens,
            banned_token_ids=request.banned_token_ids() if sample else (),
            constraints=request.constraints if sample else None,
            prompt_logprob_targets=self._prompt_logprob_targets(request, start, end),
            draft_token_ids=drafts,
            pooling=pooler.pooling_type if pooler is not None else None,
            lora_slot=request.lora_slot,
            long_rope=request.long_rope,
            previous_token=previous_token,
        )

    def _passes_original_context(self, request: Request) -> bool:
        original = self.longrope_original
        return original is not None and not request.long_rope and request.num_tokens > original

    @staticmethod
    def _mark_long_rope(request: Request) -> None:
        request.long_rope = True
        request.block_hashes.clear()  # its blocks now hash from another root (kv_manager)

    @staticmethod
    def _prompt_logprob_targets(request: Request, start: int, end: int) -> tuple[int, ...] | None:
        # The logits at position p score prompt token p + 1. They go out with the first token;
        # a request recomputed after that (preempted, or past LongRoPE's original context)
        # needs them no more.
        if (
            not request.wants_prompt_logprobs
            or request.num_output_tokens > 0
            or start >= request.num_prompt_tokens - 1
        ):
            return None
        return request.prompt_token_ids[start + 1 : min(end + 1, request.num_prompt_tokens)]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # a step in flight samples it in vain: apply() skips it
        request.num_preemptions += 1
        request.prompt_logprobs.clear()
        request.pooled = None
        self.num_preemptions += 1
        self.waiting.appendleft(request)  # by priority: back to its place
        self.num_waiting_tokens += request.num_prompt_tokens

    def can_plan_ahead(self, plan: StepPlan) -> bool:
        """Whether the next step may be planned before `plan`'s result is applied: no request
        `plan` samples for needs that token on the host to plan its next one (its grammar's
        mask, penalties over its history); no drafts, no LongRoPE switch."""
        if self.proposer is not None or self.longrope_original is not None:
            return False
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id) if chunk.sample else None
            if request is not None and (
                request.constraints is not None or request.sampling_params.has_penalties
            ):
                return False
        return True

    # ----------------------------------------------------------------- applying a result

    def apply(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Append sampled tokens, check stop conditions, free finished requests' blocks.
        Requests aborted while the step ran are skipped."""
        updates: list[RequestUpdate] = []
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            prompt_logprobs = result.prompt_logprobs.get(chunk.request_id)
            if prompt_logprobs:
                request.prompt_logprobs.extend(prompt_logprobs)
            if chunk.pooling is not None:
                part = result.pooled.get(chunk.request_id)
                request.pooled = fold(chunk.pooling, request.pooled, part)
                if chunk.start_pos + chunk.num_tokens == request.num_tokens:
                    # The prompt is done: its embedding is all an embedding request makes.
                    if request.pooled is None:
                        raise ValueError(f"request {chunk.request_id!r}: the runner pooled nothing")
                    self.running.remove(request)
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    updates.append(RequestUpdate(request, finished=True))
                continue
            if not chunk.sample:
                continue
            request.num_pending_tokens -= 1
            token_ids = result.sampled_token_ids.get(chunk.request_id)
            if not token_ids:
                continue
            drafts = chunk.draft_token_ids
            # The runner emits the drafts it accepted, then one token (core/spec_decode.verify).
            if len(token_ids) > len(drafts) + 1 or (
                drafts and list(drafts[: len(token_ids) - 1]) != token_ids[:-1]
            ):
                raise ValueError(
                    f"request {chunk.request_id!r}: the runner emitted {token_ids} for drafts "
                    f"{list(drafts)}"
                )
            if drafts:
                num_accepted = len(token_ids) - 1
                # The rejected drafts' K/V are garbage: recompute from the first of them.
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_stats.record(len(drafts), num_accepted)
            logprobs = result.logprobs.get(chunk.request_id)
            updates.append(self._append_tokens(request, token_ids, logprobs))
        return updates

    def _append_tokens(
        self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> RequestUpdate:
        """Append a step's tokens one by one, each checked for a stop; the rest are dropped
        once one finishes the request."""
        update = RequestUpdate(request)
        detokenizer = request.detokenizer
        params = request.sampling_params
        for i, token_id in enumerate(token_ids):
            request.append_output(token_id)
            update.new_token_ids.append(token_id)
            if logprobs is not None:
                request.logprobs.append(logprobs[i])
                request.cumulative_logprob += logprobs[i].logprob
                update.new_logprobs.append(logprobs[i])
            stop_string = None
            stop_token = request.is_stop_token(token_id)
            # A stop token ends the text without its own text (as OpenAI and vLLM), unless
            # asked for.
            if detokenizer is not None and (params.include_stop_str_in_output or not stop_token):
                # As vLLM: the first min_tokens tokens may not end the output, by a stop
                # string either (the banned stop tokens cannot).
                check_stops = request.num_output_tokens > params.min_tokens
                start = time.perf_counter()
                stop_string = detokenizer.update([token_id], check_stop=check_stops)
                self.detokenize_seconds += time.perf_counter() - start
            status = request.check_stop(token_id, stop_token, stop_string)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                update.finished = True
                break
        if detokenizer is not None:
            start = time.perf_counter()
            update.text_delta = detokenizer.take_delta(finished=update.finished)
            self.detokenize_seconds += time.perf_counter() - start
            if update.finished and request.stop_reason is None and detokenizer.matched_stop:
                # Found only in the last text (held for a character the output ended in the
                # middle of): the text is cut there, so the finish says so.
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = detokenizer.matched_stop
        return update

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_plan.append(request.request_id)
