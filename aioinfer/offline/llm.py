"""The offline LLM class: vLLM's `LLM.generate` / `LLM.chat` over the same AsyncEngine.

It owns a private event loop that drives the engine only while a call runs; the GPU thread
stays up between calls. Its default token budget is larger than the server's: no one waits on
a single token's latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict, cast

from aioinfer.core.beam_search import BeamSearchOutput, BeamSearchParams
from aioinfer.core.lora import LoRARequest
from aioinfer.core.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    OutputAccumulator,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from aioinfer.core.pooling import PoolingParams, cosine, score_pairs
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import TokenLogprobs
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.engine.lora_adapters import load_for_batch
from aioinfer.engine.metrics import EngineCollector
from aioinfer.engine.request_shaping import queue_all, shape
from aioinfer.engine.stream import RequestStream, gather_or_cancel
from aioinfer.offline.beam_search import beam_search
from aioinfer.offline.llm_inputs import (
    EncodedPrompt,
    GenerateBatch,
    cache_salt,
    chat_prompts,
    normalise_prompts,
    per_prompt,
    token_ids,
    utf8_text,
)
from aioinfer.offline.llm_options import llm_configs
from aioinfer.offline.metrics_reader import Metric, read_metrics
from aioinfer.offline.offline_loop import OfflineLoop
from aioinfer.offline.progress import Progress


class TextPrompt(TypedDict):
    """A prompt as text (vLLM's TextPrompt)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (vLLM's TokensPrompt)."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt | dict[str, Any]
Message = dict[str, Any]
# vLLM's: whether to show a progress bar, or a callable that makes one (tqdm's signature).
UseTqdm = bool | Callable[..., Any]


class LLM:
    """Batch generation: `LLM(model, **options)`, then `generate(...)` or `chat(...)`; with a
    pooling model (`runner="pooling"`), `embed(...)` and `score(...)`.

    `model` is a hub id, a local folder or a .gguf file; empty means the bundled
    SmolLM2-135M-Instruct. Options are the fields of ModelConfig, CacheConfig and
    SchedulerConfig (dtype, max_model_len, kv_cache_memory, max_num_batched_tokens, ...).
    """

    def __init__(self, model: str = "", **options: Any) -> None:
        runner_factory = options.pop("runner_factory", None)
        tokenizer = options.pop("tokenizer_object", None)
        model_config, cache_config, scheduler_config = llm_configs(model=model, **options)
        self._offline = OfflineLoop()
        self._queued: GenerateBatch | None = None  # what enqueue() gave wait_for_completion()
        self._token_texts: dict[int, str] = {}
        self.engine = self._offline.run(
            AsyncEngine.create(
                model_config,
                cache_config,
                scheduler_config,
                offline=True,
                runner_factory=runner_factory,
                tokenizer=tokenizer,
            )
        )

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.engine.default_sampling)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, as vLLM's LLM gives them: the series /metrics serves
        (named `aioinfer:...`), each a Counter, Gauge, Histogram or Vector."""
        return read_metrics(EngineCollector(lambda: self.engine))

    def reset_prefix_cache(self, device: str | None = None) -> bool:
        """Forget the cached prompt prefixes, so that the next batch computes every prompt
        again (vLLM's; between calls no request holds a block, so it always does). `device`:
        vLLM's choice of cache, of which there is one here."""
        scheduler = self.engine.scheduler
        assert scheduler is not None  # set once the engine started, before __init__ returned
        return scheduler.kv.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. A prompt is text, a list of token ids, or a dict with
        "prompt" or "prompt_token_ids", and optionally "cache_salt" (vLLM's: cached prefixes
        are shared only among prompts of one salt). `priority`: one per prompt, with
        scheduling_policy="priority" (lower first), as vLLM's. `lora_request`: a LoRA adapter
        for every prompt, or one (or None) per prompt; needs enable_lora=True.
        `tokenization_kwargs`: for the tokenizer's encode of text prompts, as vLLM's
        ({"add_special_tokens": False} for prompts that hold their BOS)."""
        batch = self._generate_batch(
            prompts, sampling_params, priority, lora_request, tokenization_kwargs
        )
        return self._offline.run(self._generate_all(batch, use_tqdm))

    def enqueue(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: UseTqdm = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """vLLM's: queue prompts as generate() takes them without running them; returns their
        request ids. `wait_for_completion()` runs everything queued (a generate() between
        runs only its own prompts). Prompts are tokenized here; the engine checks them against
        the model when they run."""
        del use_tqdm  # vLLM's bar over adding requests: adding is instant here
        batch = self._generate_batch(
            prompts, sampling_params, priority, lora_request, tokenization_kwargs
        )
        return self._queue(batch)

    def enqueue_chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | None = None,
        priority: int | Sequence[int] | None = None,
        **chat_options: Any,
    ) -> list[str]:
        """vLLM's: enqueue() for conversations, rendered as chat() renders them (the same
        keyword options: chat_template, tools, ...)."""
        del use_tqdm  # as in enqueue()
        encoded = chat_prompts(self.engine, messages, **chat_options)
        loras = per_prompt(lora_request, len(encoded), "lora_request", LoRARequest, optional=True)
        return self._queue(self._batch_of(encoded, sampling_params, priority, loras))

    def _queue(self, batch: GenerateBatch) -> list[str]:
        ids = [self.engine.make_request_id() for _ in batch.prompts]
        batch.request_ids = list(ids)
        if self._queued is None:
            self._queued = batch
        else:
            self._queued.extend(batch)
        return ids

    def wait_for_completion(
        self, output_type: type | tuple[type, ...] | None = None, *, use_tqdm: UseTqdm = True
    ) -> list[RequestOutput]:
        """vLLM's: run every prompt that `enqueue` queued, outputs in the order queued. One
        that the engine refuses fails the call and leaves none of them queued."""
        batch, self._queued = self._queued, None
        if output_type is not None and not issubclass(RequestOutput, output_type):
            raise TypeError(f"enqueued prompts give RequestOutput, not {output_type!r}")
        return [] if batch is None else self._offline.run(self._generate_all(batch, use_tqdm))

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: UseTqdm = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (core/beam_search.py): the best params.beam_width sequences of
        each prompt, best first, each holding the prompt's tokens and text too. `use_tqdm` and
        `concurrency_limit` are vLLM's, taken and not read: every step is one batch."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        cap = self.engine.limits.max_logprobs
        if 2 * params.beam_width > cap:  # each step asks for 2 x beam_width
            raise ValueError(
                f"beam_width must be <= {cap // 2} (each step reads 2 x beam_width logprobs, "
                f"at most --max-logprobs {cap}), got {params.beam_width}"
            )
        prompt_ids = [self._encode(p).ids for p in normalise_prompts(prompts)]
        loras = per_prompt(
            lora_request, len(prompt_ids), "lora_request", LoRARequest, optional=True
        )
        return beam_search(self.engine, self._beam_step, prompt_ids, params, loras)

    def _beam_step(
        self, prompts: list[list[int]], params: SamplingParams, loras: list[LoRARequest | None]
    ) -> list[RequestOutput]:
        """One step of beam search: a batch of token prompts, one per live beam."""
        return self.generate(
            [{"prompt_token_ids": tokens} for tokens in prompts],
            params,
            use_tqdm=False,
            lora_request=loras,
        )

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        lora_request: LoRARequest | None = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the chat template.
        A message's content is a string or a list of text parts (whatever
        `chat_template_content_format` says: text parts are joined for every template).
        `tools` (OpenAI function tools) are the template's to show, as in vLLM; the calls stay
        in the output text."""
        encoded = chat_prompts(
            self.engine,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            chat_template_content_format=chat_template_content_format,
            mm_processor_kwargs=mm_processor_kwargs,
        )
        loras = per_prompt(lora_request, len(encoded), "lora_request", LoRARequest, optional=True)
        batch = self._batch_of(encoded, sampling_params, None, loras)
        return self._offline.run(self._generate_all(batch, use_tqdm))

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: UseTqdm = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings in input order, from a pooling model (`LLM(model, runner="pooling")`, or
        an embedding checkpoint); `outputs.embedding` is the vector, as in vLLM."""
        self._check_pooling_task(classify=False)
        return self._pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: UseTqdm = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities in input order, from a `*ForSequenceClassification` checkpoint;
        `outputs.probs` as in vLLM (softmax over the labels; the sigmoid of a single one)."""
        self._check_pooling_task(classify=True)
        outputs = self._pool(prompts, None, use_tqdm, truncate_prompt_tokens)
        return [
            ClassificationRequestOutput(
                o.request_id, o.prompt, o.prompt_token_ids, ClassificationOutput(o.outputs.data)
            )
            for o in outputs
        ]

    def _check_pooling_task(self, classify: bool) -> None:
        pooler = self.engine.pooler
        if pooler is None:
            raise ValueError(
                "this model generates text: it does not serve embeddings or class "
                "probabilities (runner='pooling' makes embeddings from it; LLM.classify needs "
                "a *ForSequenceClassification model)"
            )
        if pooler.classifies != classify:
            raise ValueError(
                "this model is a classifier: use LLM.classify or LLM.score"
                if pooler.classifies
                else "this model makes embeddings, not class probabilities: use LLM.embed"
            )

    def _pool(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        use_tqdm: UseTqdm,
        truncate_prompt_tokens: int | None,
    ) -> list[EmbeddingRequestOutput]:
        batch = normalise_prompts(prompts)
        encoded = [self._encode(p) for p in batch]
        params_list = per_prompt(
            pooling_params or PoolingParams(), len(encoded), "pooling_params", PoolingParams
        )
        if truncate_prompt_tokens is not None:
            params_list = [
                dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params_list
            ]
        return self._offline.run(self._embed_all(encoded, params_list, use_tqdm))

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Each pair's score: data_1's one text against each of data_2 (1:N), or pair by pair
        (N:N). A cross-encoder (a classifier of one label) reads each pair as one prompt and
        scores its probability; an embedding model scores the cosine similarity of the texts'
        embeddings, each distinct text embedded once."""
        pairs = score_pairs(
            normalise_prompts(data_1), normalise_prompts(data_2), ("data_1", "data_2")
        )
        pooler = self.engine.pooler
        if pooler is not None and pooler.classifies:
            return self._cross_encode(pairs, truncate_prompt_tokens, use_tqdm)
        texts: list[Prompt] = []
        index: dict[str, int] = {}
        for pair in pairs:
            for text in pair:
                key = repr(text)
                if key not in index:
                    index[key] = len(texts)
                    texts.append(text)
        outputs = self.embed(texts, pooling_params, use_tqdm, truncate_prompt_tokens)
        results = []
        for number, (first, second) in enumerate(pairs):
            a, b = outputs[index[repr(first)]], outputs[index[repr(second)]]
            results.append(
                ScoringRequestOutput(
                    f"score-{number}",
                    a.prompt_token_ids + b.prompt_token_ids,
                    ScoringOutput(cosine(a.outputs.data, b.outputs.data)),
                )
            )
        return results

    def _cross_encode(
        self,
        pairs: list[tuple[Prompt, Prompt]],
        truncate_prompt_tokens: int | None,
        use_tqdm: UseTqdm,
    ) -> list[ScoringRequestOutput]:
        assert self.engine.pooler is not None
        self.engine.pooler.check_cross_encoder()
        if not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
            raise ValueError("a cross-encoder scores pairs of texts (str), not token ids or dicts")
        from aioinfer.engine.tokenizer import encode_pairs

        firsts, seconds = [str(a) for a, _ in pairs], [str(b) for _, b in pairs]
        PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)  # its range checks
        pair_ids = encode_pairs(
            self.engine.tokenizer,
            firsts,
            seconds,
            truncate_prompt_tokens,
            self.engine.max_model_len,
        )
        prompts: list[Prompt] = list(pair_ids)
        outputs = self._pool(prompts, None, use_tqdm, None)
        return [
            ScoringRequestOutput(
                f"score-{number}", o.prompt_token_ids, ScoringOutput(float(o.outputs.data[0]))
            )
            for number, o in enumerate(outputs)
        ]

    def shutdown(self) -> None:
        loop = self._offline.loop
        if not loop.is_closed():
            self._offline.run_until(loop.create_task(self.engine.shutdown()))
            loop.close()

    def __del__(self) -> None:
        # Best effort for an LLM that was never shut down: stop the GPU thread and the loop.
        offline = getattr(self, "_offline", None)
        loop = offline.loop if offline is not None else None
        if loop is not None and not loop.is_closed() and not loop.is_running():
            with contextlib.suppress(Exception):
                self.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- internals

    def _encode(
        self, prompt: Prompt, tokenization_kwargs: dict[str, Any] | None = None
    ) -> EncodedPrompt:
        kwargs = tokenization_kwargs or {}
        if isinstance(prompt, dict):
            prompt = cast(dict[str, Any], prompt)
            if prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs"):
                raise ValueError("multi_modal_data: the models served here take text only")
            salt = cache_salt(prompt)
            if "prompt_token_ids" in prompt:
                ids = token_ids(prompt["prompt_token_ids"])
                return EncodedPrompt(prompt.get("prompt"), ids, salt)
            if not isinstance(prompt.get("prompt"), str):
                raise ValueError(
                    f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got keys "
                    f"{sorted(prompt)}"
                )
            text: str = utf8_text(prompt["prompt"], "prompt")
            return EncodedPrompt(text, self.engine.tokenizer.encode(text, **kwargs), salt)
        if isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(utf8_text(prompt, "prompt"), **kwargs)
            return EncodedPrompt(prompt, ids)
        return EncodedPrompt(None, token_ids(prompt))

    def _generate_batch(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
        tokenization_kwargs: dict[str, Any] | None,
    ) -> GenerateBatch:
        if tokenization_kwargs is not None and not isinstance(tokenization_kwargs, dict):
            raise TypeError(
                f"tokenization_kwargs must be a dict, got {type(tokenization_kwargs).__name__}"
            )
        encoded = [self._encode(p, tokenization_kwargs) for p in normalise_prompts(prompts)]
        loras = per_prompt(lora_request, len(encoded), "lora_request", LoRARequest, optional=True)
        return self._batch_of(encoded, sampling_params, priority, loras)

    def _batch_of(
        self,
        encoded: list[EncodedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None,
        loras: list[LoRARequest | None],
    ) -> GenerateBatch:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = per_prompt(sampling_params, len(encoded), "sampling_params", SamplingParams)
        if isinstance(priority, int):  # enqueue's: one for every prompt
            priority = [priority] * len(encoded)
        if priority is not None and len(priority) != len(encoded):
            raise ValueError(
                f"priority must have one entry per prompt ({len(encoded)}), got {len(priority)}"
            )
        priorities = list(priority) if priority is not None else [0] * len(encoded)
        return GenerateBatch(encoded, params, priorities, loras, [None] * len(encoded))

    async def _generate_all(self, batch: GenerateBatch, use_tqdm: UseTqdm) -> list[RequestOutput]:
        streams: list[RequestStream] = []
        progress: Progress | None = None
        params_list, loras = batch.params, batch.loras
        await load_for_batch(self.engine, {lo.lora_name: lo for lo in loras if lo is not None})

        async def collect(stream: RequestStream, n: int) -> RequestOutput:
            acc = OutputAccumulator(n)
            stream.final_only()
            while True:
                output = await stream.get()
                acc.add(output)
                if output.finished:
                    if progress is not None:
                        progress.advance()
                    return acc.result()

        def add(index: int) -> RequestStream:
            prompt, lora = batch.prompts[index], loras[index]
            # A truncated prompt keeps its text, as in vLLM; its ids are the kept ones. As
            # vLLM's offline engine, output stops at the context's end ("length") rather than
            # the request failing when prompt + max_tokens exceed it.
            ids, params = shape(
                self.engine.limits, prompt.ids, params_list[index], clamp_max_tokens=True
            )
            return self.engine.add_request(
                ids,
                params,
                request_id=batch.request_ids[index],
                prompt=prompt.text,
                priority=batch.priorities[index],
                lora=lora.lora_name if lora is not None else None,
                cache_salt=prompt.cache_salt,
            )

        with self._batch(streams, lambda: progress):
            # Every request is validated and queued before the first step runs; one that fails
            # validation aborts those queued before it.
            streams += queue_all(self.engine, len(batch.prompts), add)
            if use_tqdm:
                progress = Progress(len(streams), self.engine, use_tqdm=use_tqdm)
            outputs = await asyncio.gather(
                *(collect(s, p.n) for s, p in zip(streams, params_list, strict=True))
            )
            for output, lora in zip(outputs, loras, strict=True):
                output.lora_request = lora
            return [self._with_decoded_logprobs(output) for output in outputs]

    async def _embed_all(
        self,
        encoded: list[EncodedPrompt],
        params_list: list[PoolingParams],
        use_tqdm: UseTqdm,
    ) -> list[EmbeddingRequestOutput]:
        streams: list[RequestStream] = []
        progress: Progress | None = None

        async def collect(stream: RequestStream, params: PoolingParams) -> EmbeddingRequestOutput:
            output = await self.engine.embedding_of(stream, params)
            if progress is not None:
                progress.advance()
            return output

        # Prompt tokens are counted as they are prefilled, from the count before the first.
        tokens_before = self.engine.stats.prompt_tokens
        with self._batch(streams, lambda: progress):
            # All are validated and queued before the first step runs, as in _generate_all.
            for prompt, params in zip(encoded, params_list, strict=True):
                streams.append(
                    self.engine.add_pooling_request(prompt.ids, params, prompt=prompt.text)
                )
            if use_tqdm:
                progress = Progress(len(streams), self.engine, "prompt", tokens_before, use_tqdm)
            return await gather_or_cancel(
                collect(s, p) for s, p in zip(streams, params_list, strict=True)
            )

    @contextlib.contextmanager
    def _batch(
        self, streams: list[RequestStream], progress: Callable[[], Progress | None]
    ) -> Iterator[None]:
        """Around a batch's queueing and waiting: any failure (a prompt refused, Ctrl-C)
        aborts what was queued, and the progress bar (if one was made) closes."""
        try:
            yield
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        finally:
            bar = progress()
            if bar is not None:
                bar.close()

    def _with_decoded_logprobs(self, output: RequestOutput) -> RequestOutput:
        """Logprob entries with their tokens' text (vLLM's `Logprob.decoded_token`)."""

        def decoded(entry: TokenLogprobs) -> TokenLogprobs:
            return dataclasses.replace(entry, decoded={t: self._token_text(t) for t in entry})

        for seq in output.outputs:
            if seq.logprobs:
                seq.logprobs = [decoded(entry) for entry in seq.logprobs]
        if output.prompt_logprobs:
            output.prompt_logprobs = [
                None if entry is None else decoded(entry) for entry in output.prompt_logprobs
            ]
        return output

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = self._token_texts[token_id] = tokenizer.decode([token_id])
        return text
