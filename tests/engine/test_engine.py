"""AsyncEngine and the offline LLM over a fake runner: the real scheduler, GPU thread,
detokenizer and streams, with a model stand-in that checks the KV bookkeeping."""

from __future__ import annotations

import _thread
import asyncio
import math
import signal
import threading
import time
import tracemalloc
from types import SimpleNamespace

import pytest

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.engine.stream import EngineDeadError
from aioinfer.offline.llm import LLM
from aioinfer.offline.llm_options import llm_configs
from tests.support.fake_runner import FAKE_HIDDEN, FakeRunner, next_token, reference_output
from tests.support.tokenizers import make_tokenizer

NUM_BLOCKS, BLOCK_SIZE = 64, 4


class FakeRunnerFactory:
    def __init__(
        self,
        fail_at_step: int | None = None,
        num_blocks: int = NUM_BLOCKS,
        next_token=next_token,
        pooler=None,
    ):
        self.fail_at_step = fail_at_step
        self.num_blocks = num_blocks
        self.next_token = next_token
        self.pooler = pooler  # a PoolerConfig: the fake model serves embeddings

    @staticmethod
    def resolve(model_config):
        return SimpleNamespace(served_name="fake-model")

    def __call__(self, resolved, model_config, cache_config, scheduler_config, offline):
        num_labels = len(self.pooler.labels) if self.pooler is not None else 0
        fake = FakeRunner(self.num_blocks, cache_config.block_size, self.next_token, num_labels)
        fail_at = self.fail_at_step
        info = SimpleNamespace(
            served_name="fake-model",
            vocab_size=4096,
            max_model_len=128,
            max_num_seqs=scheduler_config.max_num_seqs or 256,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens or 32,
            num_blocks=self.num_blocks,
            eos_token_ids=(1,),
            default_sampling={},
            pooler=self.pooler,
            hidden_size=FAKE_HIDDEN,
            longrope_original=None,
        )

        def execute(plan):
            if fail_at is not None and len(fake.plans) >= fail_at:
                raise RuntimeError("device lost")
            return fake.execute(plan)

        return SimpleNamespace(info=info, execute=execute, fake=fake)


def configs(**sched):
    return (
        ModelConfig(model="fake"),
        CacheConfig(block_size=BLOCK_SIZE),
        SchedulerConfig(**{"max_num_batched_tokens": 32, **sched}),
    )


async def make_engine(factory=None, **sched) -> AsyncEngine:
    return await AsyncEngine.create(
        *configs(**sched),
        runner_factory=factory or FakeRunnerFactory(),
        tokenizer=make_tokenizer(),
    )


async def collect(engine, prompt, params, request_id=None):
    text, tokens, last = {}, {}, None
    async for out in engine.generate(prompt, params, request_id):
        for seq in out.outputs:
            text[seq.index] = text.get(seq.index, "") + seq.text
            tokens.setdefault(seq.index, []).extend(seq.token_ids)
        last = out
    return text, tokens, last


async def test_generate_matches_the_reference_and_decodes_text():
    engine = await make_engine()
    tokenizer = engine.tokenizer
    try:
        prompts = [[5, 6, 7], [9] * 20, [11, 12]]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        results = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
        for prompt, (text, tokens, last) in zip(prompts, results, strict=True):
            assert tokens[0] == reference_output(prompt, 12)
            assert text[0] == tokenizer.decode(tokens[0], skip_special_tokens=True)
            assert last.finished and last.outputs[-1].finish_reason == "length"
        kv = engine.scheduler.kv
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    finally:
        await engine.shutdown()


async def test_n_sequences_and_prompt_too_long():
    engine = await make_engine()
    try:
        _, tokens, last = await collect(engine, [5, 6], SamplingParams(n=3, max_tokens=4))
        assert sorted(tokens) == [0, 1, 2]
        assert all(len(t) <= 4 for t in tokens.values())
        assert last.finished
        with pytest.raises(ValueError, match="maximum context length is 128"):
            engine.add_request([5] * 128, SamplingParams())
        with pytest.raises(ValueError, match=r"120 in the prompt, 10 for the completion"):
            engine.add_request([5] * 120, SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="token ids must be in"):
            engine.add_request([5, 4096], SamplingParams())
    finally:
        await engine.shutdown()


async def test_the_n_sequences_of_a_request_hold_one_copy_of_its_prompt():
    """Each sequence kept a tuple and a list of the whole prompt, 16 bytes a token a sequence:
    one 48 KB body (8000 token ids, n = 4096) grew the server by 491 MB. The sequences share
    one tuple now; the scheduler counts the waiting prompt tokens (--max-queued-tokens)."""
    engine = await make_engine(max_num_seqs=1)
    params = SamplingParams(n=64, max_tokens=2, ignore_eos=True)

    def held(prompt: list[int], request_id: str) -> int:
        tracemalloc.start()
        try:
            engine.add_request(prompt, params, request_id)
            return tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    try:
        short, long = [5], [5] * 120
        extra = held(long, "long") - held(short, "short")
        assert extra < 4 * 8 * len(long)  # the shared tuple and the stream's list, not 64 of each
        requests = engine.scheduler.requests
        assert all(requests[f"long-{i}"].prompt_token_ids is requests["long-0"].prompt_token_ids
                   for i in range(64))  # fmt: skip
        assert engine.scheduler.num_waiting_tokens == 64 * (len(short) + len(long))
        assert engine.abort("long") and engine.abort("short")
        assert engine.scheduler.num_waiting_tokens == 0
    finally:
        await engine.shutdown()


async def test_leaving_the_stream_early_aborts_and_frees_blocks():
    engine = await make_engine()
    try:
        agen = engine.generate([3] * 20, SamplingParams(max_tokens=100, ignore_eos=True), "r1")
        await agen.__anext__()
        await agen.aclose()
        assert engine.num_unfinished == 0
        await asyncio.sleep(0)
        kv = engine.scheduler.kv
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
        kv.check_integrity()
        assert engine.abort("r1") is False
    finally:
        await engine.shutdown()


async def test_abort_from_outside_ends_the_stream_with_abort():
    engine = await make_engine()
    try:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        task = asyncio.create_task(collect(engine, [4] * 10, params, "r2"))
        while not engine.scheduler.running:
            await asyncio.sleep(0.001)
        assert engine.abort("r2")
        _, _, last = await task
        assert last.finished and last.outputs[0].finish_reason == "abort"
    finally:
        await engine.shutdown()


async def test_engine_fault_fails_every_request_and_refuses_new_ones():
    engine = await make_engine(FakeRunnerFactory(fail_at_step=2))
    try:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        results = await asyncio.gather(
            *(collect(engine, [5 + i] * 3, params) for i in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, EngineDeadError) for r in results)
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.add_request([5], params)
    finally:
        await engine.shutdown()


def fake_llm(factory: FakeRunnerFactory, max_num_batched_tokens: int = 32, **options) -> LLM:
    return LLM(
        "fake",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=max_num_batched_tokens,
        runner_factory=factory,
        tokenizer_object=make_tokenizer(),
        **options,
    )


def test_offline_llm_returns_outputs_in_input_order():
    llm = fake_llm(FakeRunnerFactory(), max_num_batched_tokens=16)
    try:
        prompts = [[7] * n for n in (30, 1, 12, 5)]
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 9, 1, 6)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, p, out in zip(prompts, params, outputs, strict=True):
            assert out.prompt_token_ids == prompt
            assert out.outputs[0].token_ids == reference_output(prompt, p.max_tokens)
            assert out.finished
        text_out = llm.generate("hello world", SamplingParams(max_tokens=4), use_tqdm=True)
        assert text_out[0].prompt == "hello world"
        with pytest.raises(TypeError, match="unknown LLM options"):
            LLM("fake", not_an_option=1)
    finally:
        llm.shutdown()


def _assert_idle(engine: AsyncEngine) -> None:
    """Nothing left in the engine: no request, no stream, every KV block free."""
    assert engine.num_unfinished == 0 and not engine.scheduler.requests
    assert not engine._parents and not engine._children
    assert engine.scheduler.kv.usage == 0.0


async def test_a_refused_request_id_leaves_nothing_behind():
    engine = await make_engine(max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        running = asyncio.ensure_future(collect(engine, [5, 6], params, request_id="a-1"))
        await asyncio.sleep(0)
        # Its second sequence would be "a-1": refused before the first one is queued.
        with pytest.raises(ValueError, match="'a-1' is already in use"):
            engine.add_request([7, 8], SamplingParams(n=2, max_tokens=4), request_id="a")
        assert set(engine.scheduler.requests) == {"a-1"}
        _, tokens, _ = await running
        assert tokens[0] == reference_output([5, 6], 20)
        _assert_idle(engine)
    finally:
        await engine.shutdown()


async def test_requests_after_shutdown_are_refused():
    engine = await make_engine()
    await engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request([5], SamplingParams(max_tokens=2))


class SlowRunnerFactory(FakeRunnerFactory):
    """A step takes a few milliseconds, so a batch is still running when it is interrupted."""

    def __call__(self, *args):
        runner = super().__call__(*args)
        execute = runner.execute

        def slow_execute(plan):
            time.sleep(0.005)
            return execute(plan)

        runner.execute = slow_execute
        return runner


def test_offline_llm_aborts_its_batch_on_a_refused_prompt_and_on_ctrl_c():
    llm = fake_llm(SlowRunnerFactory(), max_num_batched_tokens=64)
    try:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        with pytest.raises(ValueError, match=r"max_model_len|maximum context"):
            llm.generate([[5, 6, 7], [8] * 200], params, use_tqdm=False)  # the second is too long
        _assert_idle(llm.engine)

        # Python's own Ctrl-C handler, also where the shell started us with SIGINT ignored
        # (a background job): interrupt_main does nothing without it.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.3, _thread.interrupt_main)
        try:
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                llm.generate([[5] * 10] * 8, params, use_tqdm=False)  # 118 steps of 5 ms
            timer.join()
        finally:
            signal.signal(signal.SIGINT, previous)
        _assert_idle(llm.engine)
        # The engine goes on serving.
        out = llm.generate([[7, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == reference_output([7, 7], 3)
    finally:
        llm.shutdown()


async def test_the_largest_seed_with_n_2_wraps_instead_of_failing_half_admitted():
    engine = await make_engine(queue_timeout=5.0)
    try:
        params = SamplingParams(n=2, seed=2**64 - 1, max_tokens=3, ignore_eos=True)
        _, tokens, last = await collect(engine, [5, 6], params)
        assert sorted(tokens) == [0, 1] and last.finished
        _assert_idle(engine)
        assert [params.for_sequence(i).seed for i in (0, 1)] == [2**64 - 1, 0]
    finally:
        await engine.shutdown()


@pytest.mark.parametrize(
    ("option", "value"),
    [("seed", "abc"), ("max_model_len", 128.5), ("max_model_len", "128"), ("block_size", True),
     ("kv_cache_memory", math.inf), ("max_num_seqs", 2.0), ("enable_prefix_caching", 1),
     ("served_model_name", ["a", 3])],
)  # fmt: skip
def test_llm_options_of_the_wrong_type_are_refused_by_name(option, value):
    """Options from code skip the command line's parser: each once failed later, far from its
    name (an OverflowError for inf), or was taken as another value (128.5 as 128, True as 1)."""
    with pytest.raises(ValueError, match=f"^{option} must be"):
        llm_configs(**{option: value})
    llm_configs(seed=None, max_model_len=128, kv_cache_memory=2, gpu_memory_utilization=1)


def test_vllm_s_task_option_picks_the_runner():
    runner_of = {task: llm_configs(task=task)[0].runner for task in ("embed", "score", "generate")}
    assert runner_of == {"embed": "pooling", "score": "pooling", "generate": "generate"}
    assert llm_configs()[0].runner == "auto"
    with pytest.raises(ValueError, match="task must be one of"):
        llm_configs(task="reward")
    with pytest.raises(ValueError, match="task='embed' asks for runner 'pooling', got 'generate'"):
        llm_configs(task="embed", runner="generate")


def test_offline_prompts_and_messages_are_refused_by_name():
    """Before anything is queued: bytes once read as token ids (one per byte), a lone surrogate
    reached the tokenizer's TypeError, and malformed messages an AttributeError or the
    template's error."""
    llm = fake_llm(FakeRunnerFactory())
    params = SamplingParams(max_tokens=1)
    try:
        for prompts in (b"abc", None, 5):
            with pytest.raises(TypeError, match="prompts must be"):
                llm.generate(prompts, params, use_tqdm=False)
        with pytest.raises(ValueError, match="prompt is not valid Unicode"):
            llm.generate(["fine", "a\ud800b"], params, use_tqdm=False)
        cases = [
            ("hello", TypeError, "messages must be a list"),
            ([["a"]], TypeError, "a message must be a dict"),
            ([{"content": "x"}], ValueError, "string 'role'"),
            ([{"role": "user", "content": 5}], TypeError, "content must be"),
            ([{"role": "user", "content": "a\ud800"}], ValueError, "messages is not valid Unicode"),
        ]
        for messages, error, match in cases:
            with pytest.raises(error, match=match):
                llm.chat(messages, params, use_tqdm=False)
        with pytest.raises(TypeError, match="lora_request must be LoRARequest"):
            llm.chat([{"role": "user", "content": "hi"}], params, lora_request="adapter")
        _assert_idle(llm.engine)
        [out] = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 1
    finally:
        llm.shutdown()
