"""AsyncEngine: generate() -> async iterator of RequestOutput deltas; abort(); shutdown().

Owns the scheduler (loop side) and the GPU thread (device side). The HTTP server and the
offline LLM both drive this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from aioinfer.core.constraints import ConstraintBuilder, ConstraintFactory
from aioinfer.core.detokenizer import IncrementalDetokenizer
from aioinfer.core.kv_events import KVEventLog
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.lora import LoRARequest
from aioinfer.core.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from aioinfer.core.pooling import PoolerConfig, PoolingParams, embedding
from aioinfer.core.request import Request, never_started
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.scheduler import RequestUpdate, Scheduler
from aioinfer.engine.kv_events import KVEventPublisher
from aioinfer.engine.lora_adapters import LoRAAdapters
from aioinfer.engine.model_limits import ModelLimits
from aioinfer.engine.runner_factory import DefaultRunnerFactory
from aioinfer.engine.stats import EngineStats
from aioinfer.engine.step_loop import StepLoop, StepTimeoutError
from aioinfer.engine.stream import (
    EngineDeadError,
    EngineOverloadedError,
    QueueTimeoutError,
    RequestAbortedError,
    RequestStream,
)
from aioinfer.gpu.thread import GpuThread

logger = logging.getLogger(__name__)

_request_counter = itertools.count()
_POOLING_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)


@dataclass
class _Child:
    stream: RequestStream
    index: int


@dataclass
class _Parent:
    """One request of the API: its stream and the ids of its n sequences in the scheduler."""

    stream: RequestStream
    child_ids: list[str]
    group: _Group | None = None  # set when its API request holds several prompts (or inputs)


@dataclass
class _Group:
    """An API request of several prompts (or inputs), each an engine request of its own. It has
    started once any of them was scheduled: --queue-timeout does not drop its later prompts,
    which wait behind its earlier ones."""

    name: str
    member_ids: set[str] = field(default_factory=set)  # its unfinished engine requests
    one_finished: bool = False  # (and so was scheduled)


class AsyncEngine:
    """Build with `await AsyncEngine.create(...)` on the loop that will serve it."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        offline: bool = False,
        runner_factory: Callable[..., Any] | None = None,
        tokenizer: Any = None,
        step_timeout: float | None = None,
    ) -> None:
        """`step_timeout`: seconds a step may run before the engine counts as stuck (dead)."""
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.step_timeout = step_timeout
        self.offline = offline
        self._runner_factory = runner_factory
        self.gpu = GpuThread()
        self.loras = LoRAAdapters(self.gpu)
        self.info: Any = None  # RunnerInfo from the GPU thread
        # With --kv-events-config: the prefix cache's events, published after each step.
        self.kv_events: KVEventLog | None = None
        self.kv_event_publisher: KVEventPublisher | None = None
        self.tokenizer: Any = tokenizer  # loaded at start() unless given
        self.scheduler: Scheduler | None = None
        self.stats = EngineStats()
        self.eos_token_ids: frozenset[int] = frozenset()
        self.default_sampling: dict[str, Any] = {}  # from the model's generation_config.json
        self.constraints: ConstraintBuilder | None = None  # set at start()
        self.pooler: PoolerConfig | None = None  # set at start() when the model makes embeddings
        self.limits = ModelLimits(0, 0, 0)  # the model's, set at start()
        self._children: dict[str, _Child] = {}
        self._parents: dict[str, _Parent] = {}
        self._groups: dict[str, _Group] = {}  # by name: API requests of several prompts
        self._died = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._step_loop: StepLoop | None = None
        self.dead_error: BaseException | None = None
        self.ready = False

    # ----------------------------------------------------------------- lifecycle

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> AsyncEngine:
        engine = cls(*args, **kwargs)
        try:
            await engine.start()
        except Exception:  # the thread's work must end before the error can end the process
            await asyncio.to_thread(engine.gpu.stop, None)
            raise
        except BaseException:  # cancelled by a signal: the exit does not wait for the thread
            engine.gpu.stop(timeout=0)
            raise
        return engine

    async def start(self) -> None:
        """Resolve the model, then load weights (GPU thread) and the tokenizer (a worker thread)
        at the same time; build the scheduler over the KV blocks the runner allocated."""
        factory = self._runner_factory or DefaultRunnerFactory()  # one per start
        t0 = time.perf_counter()
        resolved = await asyncio.wrap_future(
            self.gpu.call(lambda: factory.resolve(self.model_config))  # type: ignore[union-attr]
        )
        runner_future = self.gpu.create_runner(
            lambda: factory(
                resolved, self.model_config, self.cache_config, self.scheduler_config, self.offline
            )
        )
        from aioinfer.engine.tokenizer import load_tokenizer, tokenizer_eos

        if self.tokenizer is None:
            cfg = self.model_config
            self.tokenizer = await asyncio.to_thread(
                load_tokenizer, resolved, cfg.chat_template, cfg.tokenizer
            )
        runner = await asyncio.wrap_future(runner_future)
        self.info = runner.info
        self.info.init_seconds = time.perf_counter() - t0
        self.eos_token_ids = frozenset(self.info.eos_token_ids) | tokenizer_eos(self.tokenizer)
        self.default_sampling = dict(self.info.default_sampling)
        self.pooler = getattr(self.info, "pooler", None)
        self.stats = EngineStats(self.info.max_model_len)
        max_logprobs = self.model_config.max_logprobs  # -1: no cap, the whole vocabulary
        self.limits = ModelLimits(
            self.info.max_model_len,
            self.info.vocab_size,
            self.info.vocab_size if max_logprobs == -1 else max_logprobs,
            getattr(self.info, "hidden_size", 0),
        )
        self.constraints = ConstraintBuilder(
            self.tokenizer, self.info.vocab_size, self.eos_token_ids
        )
        events_config = self.cache_config.kv_events
        if events_config is not None:
            self.kv_events = KVEventLog()
            self.kv_event_publisher = KVEventPublisher(events_config)
        kv = KVCacheManager(
            self.info.num_blocks,
            self.cache_config.block_size,
            enable_prefix_caching=self.cache_config.enable_prefix_caching,
            events=self.kv_events,
        )
        self.scheduler = Scheduler(
            kv,
            max_num_seqs=self.info.max_num_seqs,
            max_num_batched_tokens=self.info.max_num_batched_tokens,
            speculation=self.scheduler_config.speculation,
            policy=self.scheduler_config.scheduling_policy,
            longrope_original=self.info.longrope_original,
        )
        self._step_loop = StepLoop(
            self.scheduler,
            self.gpu,
            self._fan_out,
            self._die,
            before_step=self.expire_queued,
            step_timeout=self.step_timeout,
            stats=self.stats,
            overlap=self.scheduler_config.async_scheduling,
        )
        self._loop_task = asyncio.get_running_loop().create_task(self._step_loop.run())
        self.ready = True

    def _check_running(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        if not self.ready:
            raise EngineDeadError("the engine is not running: not started yet, or shut down")

    async def shutdown(self) -> None:
        """Abort whatever runs, stop the step loop and the GPU thread."""
        self.abort_all("shutdown")
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        # A stuck GPU thread would only hold up the exit: it is a daemon, left behind.
        stuck = isinstance(self.dead_error, StepTimeoutError)
        await asyncio.to_thread(self.gpu.stop, 0.0 if stuck else 10.0)
        self.ready = False
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
            self.kv_event_publisher = None

    @property
    def max_model_len(self) -> int:
        return int(self.info.max_model_len)

    @property
    def model_name(self) -> str:
        """The name responses carry: the first served name, else the model's own."""
        names = self.model_config.served_model_name
        return names[0] if names else self.info.served_name

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """The other names requests may give the served model (--served-model-name a b)."""
        return self.model_config.served_model_name[1:]

    @property
    def is_healthy(self) -> bool:
        return self.ready and self.dead_error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    async def wait_dead(self) -> BaseException:
        """Returns the error once the engine died (the step loop failed)."""
        await self._died.wait()
        assert self.dead_error is not None
        return self.dead_error

    # ----------------------------------------------------------------- requests

    def make_request_id(self) -> str:
        return f"req-{next(_request_counter)}"

    def truncate_prompt(
        self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams
    ) -> list[int]:
        """The prompt cut to its `truncate_prompt_tokens` last tokens (see ModelLimits)."""
        return self.limits.truncate(prompt_token_ids, params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutput deltas until every one of the n sequences finished. Leaving the
        iteration early (a break, a cancelled handler) aborts the request."""
        stream = self.add_request(
            prompt_token_ids, params, request_id, prompt, priority=priority, lora=lora
        )
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.taken_final:
                self.abort(stream.request_id)

    def check_admission(self, num_sequences: int, num_tokens: int = 0) -> None:
        """Admission control, the one place it is enforced: raises EngineOverloadedError when
        `num_sequences` more waiting sequences would exceed --max-queued-requests, or their
        `num_tokens` prompt tokens (each sequence's counted) --max-queued-tokens; ValueError
        when they never could. It only reads counters, so callers run it before any
        tokenization (with the tokens unknown, 0) and again after; with no await between it
        and add_request the two are one atomic step."""
        self._check_running()
        if self.scheduler is None:
            return
        limits = (
            (num_sequences, self.scheduler.num_waiting, self.scheduler_config.max_queued_requests,
             "sequences", "--max-queued-requests; prompts x n, or inputs"),
            (num_tokens, self.scheduler.num_waiting_tokens,
             self.scheduler_config.max_queued_tokens, "prompt tokens",
             "--max-queued-tokens; each sequence's prompt counted"),
        )  # fmt: skip
        for wanted, waiting, limit, what, flag in limits:
            if limit is None:
                continue
            if wanted > limit:
                raise ValueError(
                    f"A request may queue at most {limit} {what} ({flag}), got {wanted}"
                )
            if waiting + wanted > limit:
                EngineStats.count(self.stats.rejected, "queue_full")
                raise EngineOverloadedError(
                    f"The server is overloaded: {waiting} {what} are waiting and the limit is "
                    f"{limit} ({flag.split(';')[0]}); retry later"
                )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        constraints: ConstraintFactory | None = None,
        priority: int = 0,
        group: str | None = None,
        lora: str | None = None,
        prompt_only: bool = False,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit one request (all n sequences) to the scheduler; raises ValueError for what
        does not fit this model, EngineDeadError once the engine died or was shut down.
        `constraints` is what `self.constraints.prepare(params)` gave, where the caller ran it
        off the loop (a grammar compile, bad words to tokenize); else it runs here. `priority`
        orders requests under --scheduling-policy priority (lower first). `group` names the API
        request of several prompts this one is part of (see expire_queued). `lora` names an
        adapter that `add_lora` loaded. `prompt_only`: echo with max_tokens 0, whose one
        sampled token the client never sees: the metrics do not count it. `cache_salt`: prefixes
        are shared only with requests of the same salt (vLLM's)."""
        self._check_running()
        assert self.scheduler is not None and self.constraints is not None
        if self.pooler is not None:
            raise ValueError(
                "This model serves embeddings (--runner pooling): use /v1/embeddings or "
                "LLM.embed; it does not generate text"
            )
        self.scheduler.check_priority(priority)
        params = params.checked_copy()
        lora_slot = self.loras.slot_of(lora)
        prompt_token_ids = self.limits.truncate(prompt_token_ids, params)
        max_tokens = self.limits.check_generation(prompt_token_ids, params)
        params = self.limits.whole_vocabulary(params)
        make_constraints = constraints or self.constraints.prepare(params)
        request_id = request_id or self.make_request_id()
        child_ids = [f"{request_id}-{i}" for i in range(params.n)] if params.n > 1 else [request_id]
        # Checked before anything is added, so that a refused request leaves nothing behind.
        for rid in {request_id, *child_ids}:
            if rid in self._parents or rid in self._children or rid in self.scheduler.requests:
                raise ValueError(f"request id {rid!r} is already in use")
        # Every sequence is built before any is queued, for the same reason. They share one
        # tuple of the prompt: n sequences hold one copy, not n.
        shared = tuple(prompt_token_ids)
        requests = [
            Request(
                child_id,
                shared,
                params.for_sequence(index),
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                detokenizer=self._make_detokenizer(prompt_token_ids, params),
                constraints=make_constraints() if make_constraints else None,
                priority=priority,
                lora_slot=lora_slot,
                cache_salt=cache_salt,
            )
            for index, child_id in enumerate(child_ids)
        ]
        stream = RequestStream(
            request_id, prompt, list(prompt_token_ids), params.n, prompt_only,
            interval=self.scheduler_config.stream_interval,
        )  # fmt: skip
        self._queue(stream, requests, group)
        return stream

    def add_pooling_request(
        self,
        prompt_token_ids: list[int],
        params: PoolingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
        group: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit one embedding request of a pooling model: its prompt is prefilled and pooled,
        and the stream's final output carries the folded parts (`stream.pooled`; `encode`
        makes them an embedding). Raises ValueError as add_request does. `cache_salt` as
        add_request's."""
        self._check_running()
        assert self.scheduler is not None
        pooler = self.pooler
        if pooler is None:
            raise ValueError(
                "This model generates text: it does not serve embeddings (--runner pooling "
                "makes embeddings from it)"
            )
        self.scheduler.check_priority(priority)
        prompt_token_ids = pooler.pooled_prompt(self.limits.truncate(prompt_token_ids, params))
        self.limits.check_embedding(prompt_token_ids, params)
        request_id = request_id or self.make_request_id()
        if request_id in self._parents or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Never sampled: one token's worth of params keeps the request's bookkeeping whole.
        request = Request(
            request_id,
            prompt_token_ids,
            _POOLING_SAMPLING,
            max_tokens=1,
            pooler=pooler,
            priority=priority,
            cache_salt=cache_salt,
        )
        stream = RequestStream(request_id, prompt, list(prompt_token_ids), 1)
        self._queue(stream, [request], group)
        return stream

    async def encode(
        self,
        prompt_token_ids: list[int],
        params: PoolingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput:
        """The embedding of one prompt (a pooling model). Cancelling the caller aborts it."""
        params = params or PoolingParams()
        stream = self.add_pooling_request(prompt_token_ids, params, request_id, prompt, priority)
        try:
            return await self.embedding_of(stream, params)
        finally:
            if not stream.taken_final:
                self.abort(stream.request_id)

    async def embedding_of(
        self, stream: RequestStream, params: PoolingParams
    ) -> EmbeddingRequestOutput:
        """Wait for the request of `add_pooling_request` and make its embedding; RequestAborted
        Error when it was aborted meanwhile. A caller that leaves early aborts the request
        itself (with its own reason), as `encode` does."""
        while not (await stream.get()).finished:
            pass
        if stream.pooled is None:
            raise RequestAbortedError(f"request {stream.request_id!r} was aborted")
        assert self.pooler is not None
        vector = embedding(stream.pooled, len(stream.prompt_token_ids), params, self.pooler)
        return EmbeddingRequestOutput(
            stream.request_id, stream.prompt, stream.prompt_token_ids, EmbeddingOutput(vector)
        )

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load a LoRA adapter (see LoRAAdapters.add)."""
        self._check_running()
        await self.loras.add(lora)

    async def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter no unfinished request uses (see LoRAAdapters.remove)."""
        self._check_running()
        assert self.scheduler is not None
        requests = self.scheduler.requests.values()
        await self.loras.remove(name, lambda slot: sum(r.lora_slot == slot for r in requests))

    def _queue(self, stream: RequestStream, requests: list[Request], group: str | None) -> None:
        """Hand a request's sequences, checked and built, to the scheduler."""
        assert self.scheduler is not None and self._step_loop is not None
        for index, request in enumerate(requests):
            self.scheduler.add(request)
            self._children[request.request_id] = _Child(stream, index)
        parent = _Parent(stream, [r.request_id for r in requests])
        if group is not None:
            parent.group = self._groups.setdefault(group, _Group(group))
            parent.group.member_ids.add(stream.request_id)
        self._parents[stream.request_id] = parent
        self._step_loop.notify()

    def abort(
        self, request_id: str, reason: str = "abort", error: BaseException | None = None
    ) -> bool:
        """The one way a request ends early: every path (client gone, write timeout, queue
        timeout, shutdown, a failed handler) comes here. Aborts all n sequences in any state
        and frees their blocks at once, so the next step sees them in the pool. Idempotent:
        only the first call for an unfinished request counts (under `reason`) and returns True.
        The consumer sees finish_reason "abort" on each unfinished sequence, or `error`."""
        parent = self._parents.pop(request_id, None)
        if parent is None or self.scheduler is None:
            return False
        self._leave_group(parent, finished=False)
        for child_id in parent.child_ids:
            child = self._children.pop(child_id, None)
            request = self.scheduler.abort(child_id)
            if child is not None and request is not None and error is None:
                child.stream.put(child.index, "", [], None, None, "abort")
        if error is not None:
            parent.stream.fail(error)
        self.stats.aborted += 1
        EngineStats.count(self.stats.aborted_by_reason, reason)
        return True

    def abort_all(self, reason: str) -> int:
        """Abort every unfinished request; returns how many there were."""
        return sum(self.abort(request_id, reason) for request_id in list(self._parents))

    def expire_queued(self, now: float | None = None) -> int:
        """Drop requests that waited longer than --queue-timeout without ever being scheduled
        (their consumers get QueueTimeoutError); returns how many. Runs before each step."""
        timeout = self.scheduler_config.queue_timeout
        if timeout is None or self.scheduler is None or not self.scheduler.waiting:
            return 0
        now = time.monotonic() if now is None else now
        expired: dict[str, float] = {}
        # Under first come, first served, never-started requests wait in arrival order: the
        # scan stops at the first young one. By priority, a young one may stand before old ones.
        in_arrival_order = self.scheduler.policy == "fcfs"
        for request in self.scheduler.waiting:
            if not never_started(request):
                continue  # preempted requests come first: they already produced output
            waited = now - request.arrival_time
            if waited < timeout:
                if in_arrival_order:
                    break
                continue
            child = self._children.get(request.request_id)
            if child is not None:
                expired.setdefault(child.stream.request_id, waited)
        count = 0
        groups_started: dict[str, bool] = {}
        for request_id, waited in expired.items():
            if not self._all_never_started(request_id):
                continue  # a sibling of n > 1 already runs: the request has started
            group = self._parents[request_id].group
            if group is not None:
                if group.name not in groups_started:
                    groups_started[group.name] = group.one_finished or not all(
                        self._all_never_started(member) for member in group.member_ids
                    )
                if groups_started[group.name]:
                    continue  # another prompt of its API request has started
            error = QueueTimeoutError(
                f"The request waited {waited:.1f} s in the queue, longer than the server's "
                f"limit of {timeout:g} s (--queue-timeout); retry later"
            )
            count += self.abort(request_id, "queue_timeout", error)
        return count

    def _all_never_started(self, request_id: str) -> bool:
        assert self.scheduler is not None
        requests = self.scheduler.requests
        return all(
            never_started(requests.get(child_id))
            for child_id in self._parents[request_id].child_ids
        )

    def _make_detokenizer(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    # ----------------------------------------------------------------- step-loop callbacks

    def _fan_out(self, updates: list[RequestUpdate]) -> None:
        if self.kv_event_publisher is not None and self.kv_events is not None:
            self.kv_event_publisher.publish(self.kv_events.drain())
        now = time.monotonic()
        for update in updates:
            child = self._children.get(update.request_id)
            if child is None:
                continue
            request = update.request
            stream = child.stream
            num_new = len(update.new_token_ids)
            self.stats.sequence_output(request, num_new, update.finished, now, stream.prompt_only)
            if child.index == 0 and request.num_output_tokens == num_new:
                stream.num_cached_tokens = request.num_cached_tokens
                if request.wants_prompt_logprobs:
                    stream.put_prompt_logprobs(request.prompt_logprobs)
            if request.pooled is not None:
                stream.pooled = request.pooled
            wants_logprobs = request.sampling_params.logprobs is not None
            stream.put(
                child.index,
                update.text_delta,
                update.new_token_ids,
                update.new_logprobs if wants_logprobs else None,
                request.cumulative_logprob if wants_logprobs else None,
                request.finish_reason,
                request.stop_reason,
            )
            if update.finished:
                del self._children[update.request_id]
                parent = self._parents.pop(stream.request_id, None) if stream.finished else None
                if parent is not None:
                    self.stats.params_n.observe(stream.n)
                    self._leave_group(parent, finished=True)

    def _leave_group(self, parent: _Parent, finished: bool) -> None:
        group = parent.group
        if group is None:
            return
        group.member_ids.discard(parent.stream.request_id)
        group.one_finished |= finished
        if not group.member_ids:
            del self._groups[group.name]

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        failure = EngineDeadError(f"engine failed: {error!r}")
        for parent in self._parents.values():
            parent.stream.fail(failure)
        self._children.clear()
        self._parents.clear()
        self._groups.clear()
        self._died.set()
