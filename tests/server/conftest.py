"""Fixtures for the server tests: the real AsyncEngine over the fake runner
(tests/support/fake_runner.py), with logprobs added and an optional per-step delay, served by the
real app through aiohttp's test client or through a live TCP site that the official `openai`
client talks to."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from aioinfer.core.step import StepPlan, StepResult, TokenLogprobs
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from tests.engine.test_engine import FakeRunnerFactory
from tests.support.fake_runner import VOCAB, next_token, reference_output
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 512
MAX_MODEL_LEN = 128  # what FakeRunnerFactory reports
MODEL = "fake-model"
API_KEYS = ("key-one", "key-two")


def fake_logprobs(token_id: int, num_top: int) -> TokenLogprobs:
    """Deterministic logprobs: the chosen token and `num_top` alternatives, best first."""
    logprob = -0.1 - (token_id % 7) / 4
    top = tuple((3 + (token_id + j) % (VOCAB - 3), -0.05 * (j + 1)) for j in range(num_top))
    return TokenLogprobs(token_id, logprob, 1 + token_id % 3, top)


class ServerRunnerFactory(FakeRunnerFactory):
    """FakeRunnerFactory whose runner also reports logprobs, and can sleep in each step (on the
    GPU thread, like a real forward pass) so that requests stay in flight for a while."""

    def __init__(
        self,
        step_delay: float = 0.0,
        num_blocks: int = NUM_BLOCKS,
        fail_at_step: int | None = None,
        next_token: Callable[[list[int]], int] = next_token,
        pooler: Any = None,
        hang_at_step: int | None = None,
        release: threading.Event | None = None,
    ) -> None:
        """`hang_at_step`: that step blocks until `release` is set (a stuck GPU thread)."""
        super().__init__(
            fail_at_step=fail_at_step, num_blocks=num_blocks, next_token=next_token, pooler=pooler
        )
        self.step_delay = step_delay
        self.hang_at_step = hang_at_step
        self.release = release

    def __call__(self, *args: Any) -> Any:
        runner = super().__call__(*args)
        execute = runner.execute
        delay = self.step_delay
        steps = iter(range(1 << 62))

        def execute_with_logprobs(plan: StepPlan) -> StepResult:
            if next(steps) == self.hang_at_step:
                assert self.release is not None
                self.release.wait()
            if delay:
                time.sleep(delay)
            result = execute(plan)
            for chunk in plan.chunks:
                params = chunk.sampling_params
                rid = chunk.request_id
                if chunk.sample and params.logprobs is not None:
                    result.logprobs[rid] = [
                        fake_logprobs(token, params.logprobs)
                        for token in result.sampled_token_ids[rid]
                    ]
                if chunk.prompt_logprob_targets and params.prompt_logprobs is not None:
                    result.prompt_logprobs[rid] = [
                        fake_logprobs(t, params.prompt_logprobs)
                        for t in chunk.prompt_logprob_targets
                    ]
            return result

        runner.execute = execute_with_logprobs
        return runner


async def build_engine(
    step_delay: float = 0.0,
    fail_at_step: int | None = None,
    num_blocks: int = NUM_BLOCKS,
    next_token: Callable[[list[int]], int] = next_token,
    pooler: Any = None,
    hang_at_step: int | None = None,
    release: threading.Event | None = None,
    step_timeout: float | None = None,
    served_model_name: tuple[str, ...] = (),
    tokenizer: Any = None,
    **sched: Any,
) -> AsyncEngine:
    """`pooler`: a PoolerConfig, for an engine that serves embeddings."""
    return await AsyncEngine.create(
        ModelConfig(model="fake", served_model_name=served_model_name),
        CacheConfig(block_size=BLOCK_SIZE),
        SchedulerConfig(**{"max_num_batched_tokens": 256, **sched}),
        runner_factory=ServerRunnerFactory(
            step_delay,
            num_blocks=num_blocks,
            fail_at_step=fail_at_step,
            next_token=next_token,
            pooler=pooler,
            hang_at_step=hang_at_step,
            release=release,
        ),
        tokenizer=tokenizer or make_tokenizer(),
        step_timeout=step_timeout,
    )


def assert_pool_free(engine: AsyncEngine) -> None:
    kv = engine.scheduler.kv
    assert engine.num_unfinished == 0
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    kv.check_integrity()


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = await build_engine()
    yield eng
    await eng.shutdown()


@pytest.fixture
async def slow_engine() -> AsyncIterator[AsyncEngine]:
    """Each step takes 20 ms: a 100-token request is in flight for about two seconds."""
    eng = await build_engine(step_delay=0.02)
    yield eng
    await eng.shutdown()


@pytest.fixture
async def client(aiohttp_client: Callable[..., Any], engine: AsyncEngine) -> Any:
    return await aiohttp_client(create_app(engine, ServerConfig()))


class LiveServer:
    """The app on a real AppRunner/TCPSite on 127.0.0.1 (default runner settings, so handlers
    are not cancelled on disconnect: the app must notice by itself)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> LiveServer:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30
        )


@pytest.fixture
async def live_factory() -> AsyncIterator[Callable[..., Any]]:
    servers: list[LiveServer] = []

    async def start(engine: Any, config: ServerConfig | None = None, **kwargs: Any) -> LiveServer:
        server = await LiveServer(create_app(engine, config or ServerConfig(), **kwargs)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def live(live_factory: Callable[..., Any], engine: AsyncEngine) -> LiveServer:
    return await live_factory(engine)


@pytest.fixture
async def oai(live: LiveServer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = live.openai()
    yield client
    await client.close()


def chat_prompt_ids(
    messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
) -> list[int]:
    """The reference prompt of a chat: Hugging Face's own template rendering."""
    ids = make_tokenizer().apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
    )
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def text_prompt_ids(text: str) -> list[int]:
    return list(make_tokenizer()(text, add_special_tokens=True)["input_ids"])


def expected_output(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """Token ids and text the fake model produces for a prompt (it never emits EOS)."""
    ids = reference_output(prompt_ids, max_tokens)
    return ids, make_tokenizer().decode(ids, skip_special_tokens=True)


# ---- a tiny random Llama behind the server, for what the fake runner cannot show (it ignores
# what the sampler is told).


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-server")
    make_variant("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
async def real_engine(tiny_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.create(
        ModelConfig(model=str(tiny_path), dtype="float32", max_model_len=128),
        CacheConfig(kv_cache_memory=0.01),
        SchedulerConfig(),
    )
    yield engine
    await engine.shutdown()


@pytest.fixture
async def real_oai(
    live_factory: Callable[..., Any], real_engine: AsyncEngine
) -> AsyncIterator[tuple[openai.AsyncOpenAI, LiveServer]]:
    server = await live_factory(real_engine)
    client = server.openai()
    yield client, server
    await client.close()
