"""Soak: a few thousand requests with random parameters against the live server over the fake
engine, mixed streaming and not, a third of them cancelled by the client at a random moment
(waiting, in prefill, mid-stream). No response may be a 5xx (or any error: every request is
valid); every request that finished must equal the fake model's reference output; afterwards
the block pool is fully free and the scheduler holds nothing."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from aioinfer.server.app import create_app
from tests.server.conftest import (
    LiveServer,
    assert_pool_free,
    build_engine,
    chat_prompt_ids,
    text_prompt_ids,
)
from tests.support.fake_runner import VOCAB, reference_output
from tests.support.tokenizers import make_tokenizer

NUM_REQUESTS = 3000
TIME_BUDGET = 50.0  # seconds: no new request after this, whatever the count
CONCURRENCY = 48
CANCEL_FRACTION = 1 / 3
WORDS = ("alpha", "beta", "gamma", "delta", "hello", "world", "server", "token", "é", "日本")


@dataclass
class Case:
    path: str
    body: dict[str, Any]
    prompts: list[list[int]]  # the prompt token ids, as the server must see them
    cancel_after: float | None
    stream: bool = field(init=False)

    def __post_init__(self) -> None:
        self.stream = bool(self.body.get("stream"))


@functools.cache
def _tokenizer() -> Any:
    return make_tokenizer()


def random_case(rng: random.Random) -> Case:
    n = rng.choice((1, 1, 2, 3))
    body: dict[str, Any] = {
        "max_tokens": rng.randint(1, 40),
        "n": n,
        "stream": rng.random() < 0.5,
        "temperature": rng.choice((0.0, 0.7, 1.0)),
        "top_p": rng.choice((1.0, 0.9)),
        "seed": rng.randint(0, 1000),
    }
    if rng.random() < 0.2:
        body["stop_token_ids"] = [rng.randint(3, VOCAB - 1)]
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.4:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        messages = [{"role": "user", "content": text}]
        body["messages"] = messages
        if rng.random() < 0.2:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
        prompts = [chat_prompt_ids(messages)]
        path = "/v1/chat/completions"
    else:
        kind = rng.random()
        if kind < 0.4:
            prompts = [[rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 30))]]
            body["prompt"] = prompts[0]
        elif kind < 0.8:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
            prompts = [text_prompt_ids(text)]
            body["prompt"] = text
        else:
            prompts = [[rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 10))]
                       for _ in range(2)]  # fmt: skip
            body["prompt"] = prompts
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 3)
        path = "/v1/completions"
    cancel_after = rng.uniform(0.0, 0.08) if rng.random() < CANCEL_FRACTION else None
    return Case(path, body, prompts, cancel_after)


def expected_choices(case: Case) -> dict[int, tuple[str, str]]:
    """Choice index -> (text, finish_reason) the fake model must produce."""
    stop_ids = case.body.get("stop_token_ids", [])
    n = case.body["n"]
    out = {}
    for p, prompt in enumerate(case.prompts):
        ids = reference_output(prompt, case.body["max_tokens"], stop_ids)
        reason = "stop" if ids and ids[-1] in stop_ids else "length"
        # The stop token's own text is not part of the output.
        text = _tokenizer().decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=True)
        for i in range(n):
            out[p * n + i] = (text, reason)
    return out


def text_of(choice: dict[str, Any], chat: bool, stream: bool) -> str:
    if not chat:
        return choice["text"]
    if stream:
        return choice["delta"].get("content", "")
    return choice["message"]["content"]


def parse_stream(raw: bytes, chat: bool) -> dict[int, tuple[str, str | None]]:
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]", events[-3:]
    got: dict[int, list[Any]] = {}
    for event in events[:-1]:
        if event.startswith(b":"):
            continue  # keep-alive comment
        chunk = orjson.loads(event.removeprefix(b"data: "))
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            entry = got.setdefault(choice["index"], ["", None])
            entry[0] += text_of(choice, chat, True)
            entry[1] = choice["finish_reason"] or entry[1]
    return {i: (t, r) for i, (t, r) in got.items()}


def parse_json(raw: bytes, chat: bool) -> dict[int, tuple[str, str | None]]:
    body = orjson.loads(raw)
    return {c["index"]: (text_of(c, chat, False), c["finish_reason"]) for c in body["choices"]}


@dataclass
class Tally:
    finished: int = 0
    cancelled: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)


async def run_case(session: aiohttp.ClientSession, url: str, case: Case, tally: Tally) -> None:
    async def call() -> None:
        async with session.post(url + case.path, json=case.body) as response:
            raw = await response.read()
            tally.statuses[response.status] = tally.statuses.get(response.status, 0) + 1
            if response.status != 200:
                tally.mismatches.append(f"{response.status} {raw[:300]!r} for {case.body}")
                return
            chat = case.path.endswith("chat/completions")
            got = parse_stream(raw, chat) if case.stream else parse_json(raw, chat)
            if got != expected_choices(case):
                tally.mismatches.append(f"{got} != {expected_choices(case)} for {case.body}")
            tally.finished += 1

    task = asyncio.ensure_future(call())
    if case.cancel_after is None:
        await task
        return
    done, _ = await asyncio.wait((task,), timeout=case.cancel_after)
    if not done:
        task.cancel()  # the client goes away: the connection closes
        tally.cancelled += 1
    await asyncio.gather(task, return_exceptions=True)


async def test_soak_random_requests_and_cancellations():
    engine = await build_engine()
    server = await LiveServer(create_app(engine)).start()
    rng = random.Random(1234)
    tally = Tally()
    started = time.monotonic()
    try:
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            gate = asyncio.Semaphore(CONCURRENCY)
            tasks = []
            for _ in range(NUM_REQUESTS):
                if time.monotonic() - started > TIME_BUDGET:
                    break
                await gate.acquire()
                task = asyncio.create_task(run_case(session, server.url, random_case(rng), tally))
                task.add_done_callback(lambda _: gate.release())
                tasks.append(task)
            results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert not tally.mismatches, tally.mismatches[:3]
        assert set(tally.statuses) == {200}, tally.statuses
        assert len(tasks) >= 1000, f"only {len(tasks)} requests in {TIME_BUDGET} s"
        assert tally.cancelled >= len(tasks) // 6 and tally.finished >= len(tasks) // 2
        deadline = time.monotonic() + 5
        while engine.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert_pool_free(engine)
        scheduler = engine.scheduler
        assert not scheduler.has_work() and not scheduler.requests
        assert engine.stats.aborted_by_reason.get("client_disconnect", 0) > 0
        print(
            f"soak: {len(tasks)} requests in {time.monotonic() - started:.1f} s, "
            f"{tally.finished} finished, {tally.cancelled} cancelled, "
            f"aborted {engine.stats.aborted_by_reason}, preemptions {scheduler.num_preemptions}"
        )
    finally:
        await server.stop()
        await engine.shutdown()
