"""The engine side of one HTTP generation request: admission control, one engine request per
prompt (admitted all or none), their merged output deltas, the one abort path, and the HTTP
errors for what the engine fails a request with."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from aioinfer.core.constraints import ConstraintFactory, InvalidGrammarError
from aioinfer.core.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.request_shaping import queue_all as queue_all_or_none
from aioinfer.engine.request_shaping import shape
from aioinfer.engine.stream import (
    EngineDeadError,
    EngineOverloadedError,
    QueueTimeoutError,
    RequestStream,
)
from aioinfer.server.http.errors import (
    APIError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    ServiceUnavailableError,
)
from aioinfer.server.http.work_queue import RETRY_AFTER, WorkQueue
from aioinfer.server.serving.context import Prompt, ResponseContext
from aioinfer.server.serving.protocol import MAX_N

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine

# Bounds the engine requests one HTTP request can create (prompts x n), checked before any
# tokenization, and n on its own: 256 sequences of one prompt (OpenAI allows 128; vLLM's
# default max_num_seqs is 256), each a request of the scheduler's.
MAX_SEQUENCES_PER_REQUEST = 4096


def admit(
    engine: AsyncEngine,
    num_prompts: int,
    n: int,
    field: str = "prompt",
    *,
    num_tokens: int = 0,
    tokens_field: str | None = None,
) -> None:
    """Admission control, run after parsing and before any tokenization work (and again
    after it, with `num_tokens`: the prompts' tokens, each sequence counting them): 400 for a
    request that can never be admitted, a fast 503 with Retry-After while the queue is full.
    `field` holds the prompts: "input" for embeddings, which have no n; `tokens_field` names
    them where a refusal is about their tokens (default: `field`)."""
    if n > MAX_N:
        raise BadRequestError(
            f"n must be at most {MAX_N} (sequences of one prompt in one request), got {n}",
            param="n",
        )
    total = num_prompts * n
    param = "n" if num_prompts == 1 and field == "prompt" else field
    if total > MAX_SEQUENCES_PER_REQUEST:
        counted = "sequences (prompts x n)" if field == "prompt" else "texts to embed"
        raise BadRequestError(
            f"A request may ask for at most {MAX_SEQUENCES_PER_REQUEST} {counted}, got "
            + (f"{num_prompts} x {n}" if field == "prompt" else str(num_prompts)),
            param=param,
        )
    try:
        engine.check_admission(total, num_tokens * n)
    except EngineOverloadedError as exc:
        raise _retry_later(exc) from None
    except EngineDeadError as exc:
        raise _engine_failed(exc) from None
    except ValueError as exc:
        about_tokens = "prompt tokens" in str(exc)
        raise BadRequestError(
            str(exc), param=(tokens_field or field) if about_tokens else param
        ) from None


# The most prompt logprob entries one request may ask for: its prompt tokens x (alternatives
# + 1) x n, echoed ones (completions' echo with logprobs) and vLLM's prompt_logprobs each
# counted. An entry costs about 120 bytes in the engine and 100 to 330 in the answer being
# built, so a request stays within about 70 MB; 2000 tokens x 21 made a 1.1 MB answer of a
# 12.8 KB body, and a 16 MiB body of 4096 prompts about 1.4 GB.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 17


def check_prompt_logprobs(
    prompts: list[Prompt], n: int, prompt_logprobs: int | None, echo_logprobs: int | None = None
) -> None:
    """400 naming the field when the prompt logprobs a request asks for (`prompt_logprobs`
    alternatives, and `echo_logprobs` for the echoed prompt: None where not asked) would hold
    more than MAX_PROMPT_LOGPROB_ENTRIES entries; run once the prompts are tokenized."""
    if prompt_logprobs is None and echo_logprobs is None:
        return
    num_tokens = n * sum(len(p.token_ids) for p in prompts)
    asked = {
        "prompt_logprobs": 0 if prompt_logprobs is None else num_tokens * (prompt_logprobs + 1),
        "logprobs": 0 if echo_logprobs is None else num_tokens * (echo_logprobs + 1),
    }
    total = sum(asked.values())
    if total > MAX_PROMPT_LOGPROB_ENTRIES:
        param = max(asked, key=asked.__getitem__)
        raise BadRequestError(
            f"{param}: a request may ask for at most {MAX_PROMPT_LOGPROB_ENTRIES} prompt "
            f"logprob entries (prompt tokens x (alternatives + 1) x n, echoed ones included), "
            f"got {total}; send fewer or shorter prompts, or ask for fewer alternatives",
            param=param,
        )


# Grammar compiles run on threads of their own (see WorkQueue): a few large specs (up to a
# second each) then wait for each other instead of holding up every request's off-loop parsing
# and tokenizing.
COMPILES = WorkQueue("structured-output specs to compile", "grammar", threads=2, max_waiting=16)


async def prepare_constraints(
    request: web.Request, engine: AsyncEngine, params: SamplingParams, param: str | None
) -> ConstraintFactory | None:
    """The request's token constraints, built on a grammar thread: a grammar compile (of
    `param`, the field that asked for it) or many bad words to tokenize do not hold up the
    event loop. Under the disconnect watcher: a client that leaves while its compile waits
    cancels it. 400 for a spec that does not compile, 503 while too many compiles wait."""
    if engine.constraints is None or not params.has_constraints:
        return None
    try:
        return await COMPILES.run(request, engine.constraints.prepare, params)
    except RecursionError:
        raise BadRequestError(f"{param} nests too deeply", param=param) from None
    except InvalidGrammarError as exc:
        where = {
            "response_format": "response_format.json_schema.schema",
            "tools": "the parameters schema of a tool",
        }.get(param or "", f"structured_outputs.{exc.kind}")
        raise BadRequestError(f"{where} is invalid: {exc.detail}", param=param) from None
    except ValueError as exc:
        raise BadRequestError(str(exc), param=_engine_param(str(exc), "prompt")) from None


def truncate_prompts(
    engine: AsyncEngine, prompts: list[Prompt], params: SamplingParams
) -> list[Prompt]:
    """The prompts as `truncate_prompt_tokens` leaves them: usage and echo count what the
    model sees."""
    try:
        kept = [engine.truncate_prompt(p.token_ids, params) for p in prompts]
    except ValueError as exc:
        raise BadRequestError(str(exc), param="truncate_prompt_tokens") from None
    return [p if ids is p.token_ids else Prompt(ids) for p, ids in zip(prompts, kept, strict=True)]


class Generation:
    """The engine requests of one HTTP request (one per prompt) and their merged outputs.

    Whoever iterates it must call `abort_unfinished(reason)` when done (a finally block): that
    is the HTTP side of the one abort path, and a no-op once every request finished.

    `prompt_only` (echo with max_tokens 0, for scoring a prompt) hides the one token the engine
    must sample: the client sees the prompt's logprobs and no output."""

    def __init__(
        self,
        engine: AsyncEngine,
        streams: list[RequestStream],
        prompt_only: bool = False,
    ) -> None:
        self.engine = engine
        self.streams = streams
        self.prompt_only = prompt_only

    def deltas(self, idle: float = 0.0) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
        """(prompt index, delta) as they arrive, and None whenever `idle` seconds pass without
        one (0: never). Raises what the engine failed a request with (EngineDeadError,
        QueueTimeoutError)."""
        timeout = idle if idle > 0 else None
        return self._single(timeout) if len(self.streams) == 1 else self._merged(timeout)

    async def _single(
        self, timeout: float | None
    ) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
        stream = self.streams[0]
        while True:
            output = await stream.get_within(timeout)
            if output is None:
                yield None
                continue
            yield 0, self._shown(output)
            if output.finished:
                return

    async def _merged(
        self, timeout: float | None
    ) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
        pending = {asyncio.ensure_future(s.get()): i for i, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(
                    pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    yield None
                    continue
                for future in sorted(done, key=pending.__getitem__):
                    index = pending.pop(future)
                    output = future.result()
                    yield index, self._shown(output)
                    if not output.finished:
                        pending[asyncio.ensure_future(self.streams[index].get())] = index
        finally:
            for future in pending:
                if future.done():
                    if not future.cancelled():
                        future.exception()  # retrieved: no "never retrieved" warning
                else:
                    future.cancel()

    def _shown(self, output: RequestOutput) -> RequestOutput:
        if not self.prompt_only:
            return output
        hidden = [
            CompletionOutput(
                seq.index,
                "",
                [],
                logprobs=[] if seq.logprobs is not None else None,
                # The one sampled token is the limit reached, whatever it was.
                finish_reason="length"
                if seq.finish_reason in ("stop", "length")
                else seq.finish_reason,
            )
            for seq in output.outputs
        ]
        return dataclasses.replace(output, outputs=hidden)

    async def finals(self) -> list[RequestOutput]:
        for stream in self.streams:
            stream.final_only()
        accumulators = [OutputAccumulator(s.n) for s in self.streams]
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for item in deltas:
                if item is not None:
                    accumulators[item[0]].add(item[1])
        return [a.result() for a in accumulators]

    def abort_unfinished(self, reason: str) -> None:
        for stream in self.streams:
            if not stream.taken_final:
                self.engine.abort(stream.request_id, reason)


def start_generation(
    engine: AsyncEngine,
    ctx: ResponseContext,
    params: SamplingParams,
    *,
    clamp_max_tokens: bool,
    what: str = "prompt",
    prompt_only: bool = False,
    constraints: ConstraintFactory | None = None,
    priority: int = 0,
) -> Generation:
    """Admit one engine request per prompt, all or none. A default max_tokens (not the
    client's) shrinks to what the context leaves. `constraints`: from `prepare_constraints`."""
    if engine.pooler is not None:
        raise BadRequestError(
            f"The model {engine.model_name!r} serves embeddings (--runner pooling): it does not "
            "generate text; use /v1/embeddings",
            param="model",
        )
    if ctx.lora is not None and ctx.lora not in engine.loras.slots:
        raise NotFoundError(
            f"The model `{ctx.lora}` does not exist (its LoRA adapter was unloaded).",
            param="model",
        )

    def add(index: int) -> RequestStream:
        prompt = ctx.prompts[index]
        _, prompt_params = shape(
            engine.limits, prompt.token_ids, params, clamp_max_tokens=clamp_max_tokens
        )
        base = ctx.engine_id or ctx.response_id
        request_id = base if len(ctx.prompts) == 1 else f"{base}-{index}"
        return engine.add_request(
            prompt.token_ids,
            prompt_params,
            request_id,
            prompt.text,
            constraints,
            priority=priority,
            group=base if len(ctx.prompts) > 1 else None,
            lora=ctx.lora,
            prompt_only=prompt_only,
            cache_salt=ctx.cache_salt,
        )

    streams = queue_all(
        engine, len(ctx.prompts), add, lambda message, _index: _engine_param(message, what)
    )
    return Generation(engine, streams, prompt_only)


def queue_all(
    engine: AsyncEngine,
    count: int,
    add: Callable[[int], RequestStream],
    param_of: Callable[[str, int], str],
) -> list[RequestStream]:
    """`add(i)` for each of a request's `count` prompts, all or none (request_shaping's):
    400 naming `param_of(message, i)` for what does not fit, 503 once the engine died."""
    added = 0

    def counted(index: int) -> RequestStream:
        nonlocal added
        stream = add(index)
        added += 1
        return stream

    try:
        return queue_all_or_none(engine, count, counted)
    except EngineDeadError as exc:
        raise _engine_failed(exc) from None
    except ValueError as exc:
        raise BadRequestError(str(exc), param=param_of(str(exc), added)) from None


def generation_error(exc: BaseException) -> APIError | None:
    """The HTTP error for what the engine failed a request with; None for anything else."""
    if isinstance(exc, EngineDeadError):
        return InternalServerError(f"The engine failed while generating: {exc}")
    if isinstance(exc, QueueTimeoutError):
        return _retry_later(exc)
    return None


def _retry_later(exc: Exception) -> ServiceUnavailableError:
    """503 for a full or slow queue: the request may succeed a moment later."""
    return ServiceUnavailableError(str(exc), headers={"Retry-After": RETRY_AFTER})


def _engine_failed(exc: EngineDeadError) -> ServiceUnavailableError:
    """503 for a request refused because the engine died before admitting it."""
    return ServiceUnavailableError(f"The engine failed: {exc}")


_ENGINE_PARAMS = (
    "priority",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "stop_token_ids",
    "min_tokens",
    "n",
    "allowed_token_ids",
    "truncate_prompt_tokens",
)


def _engine_param(message: str, default: str) -> str:
    """The field an engine ValueError is about (its messages name the field)."""
    first = message.split(" ", 1)[0]
    if first == "logprobs" and default == "messages":
        return "top_logprobs"  # chat asks for alternatives with top_logprobs
    if first in _ENGINE_PARAMS:
        return first
    if "max_tokens" in message or "you requested" in message:
        return "max_tokens"
    return default
