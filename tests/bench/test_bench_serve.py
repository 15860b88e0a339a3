"""`aioinfer bench serve` against a fake OpenAI-compatible server on 127.0.0.1 whose chunks come
at known delays: metric arithmetic, request counts, errors, Poisson arrivals, datasets and the
loopback guard."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from aioinfer.bench import serve
from aioinfer.bench.datasets import (
    SHAREGPT_OUTPUT,
    SHAREGPT_PROMPT,
    TextMaker,
    make_dataset,
)
from aioinfer.bench.serve import RequestRecord, ServeBenchConfig
from tests.support.tokenizers import make_tokenizer

MODEL = "fake-model"
# Chunks cannot come sooner than the server's sleeps, so lower bounds are tight; upper bounds
# leave room for a busy machine.
SLACK = 0.08


class FakeServer:
    """Streams max_tokens one-word chunks: the first after `ttft` seconds, the others `itl`
    apart, then a finish chunk, a usage chunk (when asked and `usage` is on) and [DONE]."""

    def __init__(
        self,
        ttft: float = 0.0,
        itl: float = 0.0,
        fail: Callable[[int], bool] = lambda n: False,
        usage: bool = True,
        delta_key: str = "content",
    ) -> None:
        """`delta_key`: where a chat chunk's text goes (`reasoning`: a model still thinking)."""
        self.ttft, self.itl, self.fail, self.usage = ttft, itl, fail, usage
        self.delta_key = delta_key
        self.bodies: list[dict[str, Any]] = []
        self.received_at: list[float] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.url = ""

    def start(self) -> FakeServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received_at.append(time.perf_counter())
        self.bodies.append(body)
        if self.fail(len(self.bodies)):
            error = {"error": {"message": "boom", "type": "server_error", "code": 500}}
            return web.json_response(error, status=500)
        chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(self.ttft)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(self.itl)
            await self._send(response, [self._choice(chat, " word", None)])
        await self._send(response, [self._choice(chat, "", "length")])
        if self.usage and body.get("stream_options", {}).get("include_usage"):
            prompt = body["prompt"] if not chat else body["messages"][-1]["content"]
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": body["max_tokens"]}
            await self._send(response, [], usage=usage)
        await response.write(b"data: [DONE]\n\n")
        return response

    def _choice(self, chat: bool, text: str, finish: str | None) -> dict[str, Any]:
        if chat:
            return {"index": 0, "delta": {self.delta_key: text}, "finish_reason": finish}
        return {"index": 0, "text": text, "finish_reason": finish}

    @staticmethod
    async def _send(response: web.StreamResponse, choices: list[Any], **extra: Any) -> None:
        event = {"id": "x", "object": "text_completion", "choices": choices, **extra}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def start(**kwargs: Any) -> FakeServer:
        started.append(FakeServer(**kwargs).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


def config_for(server: FakeServer, **overrides: Any) -> ServeBenchConfig:
    values: dict[str, Any] = {
        "base_url": server.url,
        "num_prompts": 4,
        "input_len": 12,
        "output_len": 5,
        "concurrency": 2,
    }
    return ServeBenchConfig(**{**values, **overrides})


# ----------------------------------------------------------------------------- timings


def test_one_request_times_every_chunk(fake_server):
    server = fake_server(ttft=0.06, itl=0.02)
    payload = {"model": MODEL, "prompt": "a b c", "max_tokens": 5, "stream": True}

    async def go() -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            url = server.url + "/v1/completions"
            return await serve.send_request(session, url, payload, {}, 10.0, chat=False)

    record = asyncio.run(go())
    assert record.ok and record.error is None
    assert record.chunks == 5 and record.text == " word" * 5
    assert record.output_tokens is None  # no include_usage asked for
    assert 0.055 <= record.ttft < 0.06 + SLACK
    assert len(record.itl) == 4
    # The server sleeps in sequence, so chunk k cannot arrive before ttft + k * itl; a single
    # gap may look shorter when the chunk before it was late.
    arrivals = np.cumsum([record.ttft, *record.itl])
    assert all(t >= 0.06 + k * 0.02 - 0.002 for k, t in enumerate(arrivals))
    assert 0.015 <= statistics.fmean(record.itl) < 0.02 + SLACK
    # E2E ends at the finish chunk, right after the last text chunk.
    assert record.e2e == pytest.approx(record.ttft + sum(record.itl), abs=0.02)


def test_metrics_follow_the_server_delays(fake_server, tmp_path):
    server = fake_server(ttft=0.06, itl=0.02)
    result_file = tmp_path / "result.json"
    result = serve.main(config_for(server, result_file=str(result_file)))

    assert len(server.bodies) == 1 + 4  # the warm-up is sent but not counted
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["model"] == MODEL  # read from /v1/models
    assert result["output_tokens_from"] == ["usage"]
    assert result["mean_output_tokens"] == 5 and result["short_outputs"] == 0
    assert result["mean_prompt_tokens"] == 12
    assert 0.06 * 1000 <= result["ttft_ms"]["mean"] < (0.06 + SLACK) * 1000
    for metric in ("itl_ms", "tpot_ms"):
        assert 0.015 * 1000 <= result[metric]["mean"] < (0.02 + SLACK) * 1000
    expected_e2e = 0.06 + 4 * 0.02
    assert expected_e2e * 1000 <= result["e2e_ms"]["mean"] < (expected_e2e + 3 * SLACK) * 1000
    for metric in serve.METRICS:
        stats = result[f"{metric}_ms"]
        assert stats["p50"] <= stats["p90"] <= stats["p99"]
    # Two waves of two requests at concurrency 2.
    duration = result["duration_s"]
    assert duration >= 2 * expected_e2e
    assert result["request_throughput"] == pytest.approx(4 / duration)
    assert result["output_throughput"] == pytest.approx(4 * 5 / duration)
    assert result["total_token_throughput"] == pytest.approx(4 * (5 + 12) / duration)
    written = json.loads(result_file.read_text())
    assert written["completed"] == 4 and written["model_id"] == MODEL
    assert (written["num_prompts"], written["max_concurrency"]) == (4, 2)
    assert written["request_rate"] == "inf" and written["duration"] == duration


def test_payload_asks_for_streamed_usage_and_exact_lengths(fake_server):
    server = fake_server()
    asyncio.run(serve.run_benchmark(config_for(server, model="named", seed=3)))
    warmup, *measured = server.bodies
    prompts = [b["prompt"] for b in measured]
    # Sent two at a time, so they may arrive in either order within a pair.
    assert sorted(prompts) == sorted(s.prompt for s in make_dataset("random", 4, 12, 5, seed=3))
    assert warmup["prompt"] not in prompts
    for body in server.bodies:
        assert body["model"] == "named"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 5 and "min_tokens" not in body  # as vLLM's tool
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert len(body["prompt"].split()) == 12

    assert all("top_p" not in b and "top_k" not in b for b in server.bodies)

    server.bodies.clear()
    asyncio.run(serve.run_benchmark(config_for(server, ignore_eos="min-tokens", warmup=0)))
    assert all(b["ignore_eos"] is True and b["min_tokens"] == 5 for b in server.bodies)

    server.bodies.clear()
    asyncio.run(serve.run_benchmark(config_for(server, ignore_eos="none", warmup=0)))
    assert all("ignore_eos" not in b and "min_tokens" not in b for b in server.bodies)

    server.bodies.clear()
    sampled = config_for(server, warmup=0, temperature=0.8, top_p=0.95, top_k=40)
    asyncio.run(serve.run_benchmark(sampled))
    assert [(b["temperature"], b["top_p"], b["top_k"]) for b in server.bodies] == [
        (0.8, 0.95, 40)
    ] * 4


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_text_counts_as_text(fake_server, key):
    """A model that only thinks still answers: `reasoning` (vLLM, aioinfer) and
    `reasoning_content` (llama.cpp) time the first token alike."""
    server = fake_server(ttft=0.05, delta_key=key)
    result = asyncio.run(serve.run_benchmark(config_for(server, endpoint="chat")))
    assert (result["completed"], result["failed"]) == (4, 0)
    assert 0.05 * 1000 <= result["ttft_ms"]["mean"] < (0.05 + SLACK) * 1000


def test_chat_endpoint_without_usage_counts_chunks(fake_server):
    server = fake_server(usage=False)
    config = config_for(server, endpoint="chat", dataset="sharegpt-like", num_prompts=3)
    result = asyncio.run(serve.run_benchmark(config))
    assert result["completed"] == 3
    assert result["output_tokens_from"] == ["chunks"]
    samples = make_dataset("sharegpt-like", 3, 0, 0, seed=0)
    assert [b["messages"] for b in server.bodies[1:]] == [s.messages for s in samples]
    assert result["total_output_tokens"] == sum(s.output_len for s in samples)
    assert result["total_input_tokens"] == sum(s.prompt_len for s in samples)


# ----------------------------------------------------------------------------- arithmetic


def test_summary_arithmetic_matches_numpy():
    samples = make_dataset("random", 5, 4, 10, seed=0)
    records = [
        RequestRecord(ok=True, ttft=0.1 * (i + 1), e2e=0.1 * (i + 1) + 0.9, output_tokens=10)
        for i in range(4)
    ]
    records[0].itl = [0.1, 0.2]
    records[1].itl = [0.3]
    records.append(RequestRecord(ok=False, error="HTTP 500: boom"))
    result = serve.summarize(records, samples, duration=2.0)

    ttfts = [0.1, 0.2, 0.3, 0.4]
    for q in (50, 90, 99):
        assert result["ttft_ms"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q) * 1000)
        assert result["itl_ms"][f"p{q}"] == pytest.approx(np.percentile([0.1, 0.2, 0.3], q) * 1e3)
    assert result["ttft_ms"]["mean"] == pytest.approx(250)
    assert result["tpot_ms"]["mean"] == pytest.approx(0.9 / 9 * 1000)
    assert result["e2e_ms"]["p50"] == pytest.approx((0.25 + 0.9) * 1000)
    assert (result["completed"], result["failed"]) == (4, 1)
    assert result["error_samples"] == ["HTTP 500: boom"]
    assert result["request_throughput"] == pytest.approx(2.0)
    assert result["output_throughput"] == pytest.approx(20.0)
    assert result["total_token_throughput"] == pytest.approx((40 + 16) / 2.0)
    # The same under vLLM's flat names, its std numpy's.
    assert result["duration"] == 2.0
    assert result["mean_ttft_ms"] == result["ttft_ms"]["mean"]
    assert result["median_ttft_ms"] == pytest.approx(np.median(ttfts) * 1000)
    assert result["std_ttft_ms"] == pytest.approx(np.std(ttfts) * 1000)
    assert result["p99_itl_ms"] == result["itl_ms"]["p99"]
    assert result["p90_e2el_ms"] == result["e2e_ms"]["p90"]
    assert result["mean_tpot_ms"] == result["tpot_ms"]["mean"]


def test_single_token_outputs_have_no_tpot():
    samples = make_dataset("random", 1, 4, 1, seed=0)
    record = RequestRecord(ok=True, ttft=0.1, e2e=0.1, output_tokens=1)
    result = serve.summarize([record], samples, duration=1.0)
    assert result["tpot_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert result["ttft_ms"]["p99"] == pytest.approx(100)


# ----------------------------------------------------------------------------- errors


def test_server_errors_are_counted_with_samples(fake_server):
    server = fake_server(fail=lambda n: True)
    result = asyncio.run(serve.run_benchmark(config_for(server, warmup=0, num_prompts=5)))
    assert (result["completed"], result["failed"]) == (0, 5)
    assert len(server.bodies) == 5
    assert result["error_samples"] and result["error_samples"][0].startswith("HTTP 500")
    assert result["request_throughput"] == 0 and result["output_throughput"] == 0
    assert result["ttft_ms"]["mean"] is None


def test_some_failures_leave_the_rest_measured(fake_server):
    server = fake_server(fail=lambda n: n % 3 == 0)  # the warm-up is request 1
    result = asyncio.run(serve.run_benchmark(config_for(server, num_prompts=6, concurrency=1)))
    assert (result["completed"], result["failed"]) == (4, 2)
    assert result["total_output_tokens"] == 4 * 5


def test_failed_warm_up_stops_the_benchmark(fake_server):
    server = fake_server(fail=lambda n: True)
    with pytest.raises(serve.BenchError, match="warm-up"):
        asyncio.run(serve.run_benchmark(config_for(server)))
    assert len(server.bodies) == 1


def test_a_slow_server_times_out(fake_server):
    server = fake_server(ttft=0.5)
    config = config_for(server, warmup=0, num_prompts=2, timeout=0.2)
    result = asyncio.run(serve.run_benchmark(config))
    assert result["failed"] == 2
    assert "TimeoutError" in result["error_samples"][0]


# ----------------------------------------------------------------------------- arrivals


def test_poisson_arrivals_are_seeded():
    first = serve.arrival_times(4000, 20.0, seed=1)
    assert first == serve.arrival_times(4000, 20.0, seed=1)
    assert first != serve.arrival_times(4000, 20.0, seed=2)
    assert first[0] == 0.0 and first == sorted(first)
    gaps = np.diff(first)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.06)
    # Exponential gaps: the standard deviation equals the mean.
    assert float(np.std(gaps)) == pytest.approx(1 / 20.0, rel=0.1)
    assert serve.arrival_times(3, math.inf, seed=1) == [0.0, 0.0, 0.0]


def test_requests_are_sent_at_their_arrival_times(fake_server):
    server = fake_server()
    config = config_for(server, num_prompts=6, request_rate=25.0, concurrency=None, seed=5)
    asyncio.run(serve.run_benchmark(config))
    received = np.array(server.received_at[1:])
    expected = np.array(serve.arrival_times(6, 25.0, seed=5))
    assert np.abs((received - received[0]) - expected).max() < 0.05


# ----------------------------------------------------------------------------- datasets


def test_random_prompts_are_reproducible_and_exact():
    first = make_dataset("random", 8, 32, 16, seed=7)
    assert first == make_dataset("random", 8, 32, 16, seed=7)
    assert first != make_dataset("random", 8, 32, 16, seed=8)
    assert all(len(s.prompt.split()) == s.prompt_len == 32 for s in first)
    assert all(s.output_len == 16 and s.messages[-1]["content"] == s.prompt for s in first)


def test_tokenizer_gives_exact_token_counts():
    tokenizer = make_tokenizer()
    for sample in make_dataset("random", 6, 40, 8, seed=1, tokenizer=tokenizer):
        assert len(tokenizer.encode(sample.prompt, add_special_tokens=False)) == 40
    maker = TextMaker(tokenizer)
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in maker.words)


def test_sharegpt_like_conversations():
    samples = make_dataset("sharegpt-like", 200, 0, 0, seed=4)
    assert samples == make_dataset("sharegpt-like", 200, 0, 0, seed=4)
    for sample in samples:
        assert SHAREGPT_PROMPT[2] <= sample.prompt_len <= SHAREGPT_PROMPT[3]
        assert SHAREGPT_OUTPUT[2] <= sample.output_len <= SHAREGPT_OUTPUT[3]
        roles = [m["role"] for m in sample.messages]
        assert roles[-1] == "user" and len(roles) % 2 == 1
        assert sum(len(m["content"].split()) for m in sample.messages) == sample.prompt_len
    lengths = [s.prompt_len for s in samples]
    assert len(set(lengths)) > 50  # a spread of lengths, not one shape
    assert statistics.median(lengths) == pytest.approx(SHAREGPT_PROMPT[0], rel=0.25)


# ----------------------------------------------------------------------------- guard


@pytest.mark.parametrize(
    "url", ["http://10.1.2.3:8000", "https://example.com", "http://192.168.0.2", "ftp://127.0.0.1"]
)
def test_non_loopback_urls_are_refused(url):
    with pytest.raises(ValueError, match="base_url"):
        ServeBenchConfig(base_url=url)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:8000/v1", "http://127.3.0.1", "http://[::1]"]
)
def test_loopback_urls_are_accepted(url):
    assert ServeBenchConfig(base_url=url).base_url == url


def test_allow_remote_lifts_the_guard():
    assert ServeBenchConfig(base_url="http://10.1.2.3:8000", allow_remote=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("endpoint", "embeddings"),
        ("dataset", "sonnet"),
        ("num_prompts", 0),
        ("request_rate", 0),
        ("temperature", -0.5),
        ("top_p", 1.5),
    ],
)
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ServeBenchConfig(**{field: value})


# ----------------------------------------------------------------------------- comparison


def test_comparison_takes_medians_over_runs(tmp_path):
    samples = make_dataset("random", 2, 4, 3, seed=0)
    paths = []
    for run, ttft in enumerate([0.1, 0.3, 0.2]):
        records = [RequestRecord(ok=True, ttft=ttft, e2e=ttft + 0.2, output_tokens=3)] * 2
        result = serve.summarize(records, samples, duration=1.0 + run)
        path = tmp_path / f"engine-c2-r{run}.json"
        path.write_text(json.dumps(result))
        paths.append(str(path))
    failed = serve.summarize([RequestRecord(error="x")] * 2, samples, duration=1.0)
    (tmp_path / "other-c2-r0.json").write_text(json.dumps(failed))
    paths.append(str(tmp_path / "other-c2-r0.json"))

    rows = serve.compare_results(paths)
    assert set(rows) == {"engine-c2", "other-c2"}
    assert rows["engine-c2"]["runs"] == 3 and rows["engine-c2"]["failed"] == 0
    assert rows["engine-c2"]["TTFT p50"] == pytest.approx(200)
    assert rows["engine-c2"]["req/s"] == pytest.approx(statistics.median([2, 1, 2 / 3]))
    assert rows["engine-c2"]["TPOT p50"] == pytest.approx(100)
    assert rows["other-c2"]["failed"] == 2 and rows["other-c2"]["TTFT p50"] is None
    serve.print_comparison(paths)


def test_short_conversations_still_split_into_turns(monkeypatch):
    from aioinfer.bench import datasets

    monkeypatch.setattr(datasets, "SHAREGPT_PROMPT", (4.0, 0.0, 4, 4))
    monkeypatch.setattr(datasets, "SHAREGPT_TURNS", (0.0, 0.0, 1.0))
    for sample in make_dataset("sharegpt-like", 5, 0, 0, seed=0):
        assert sample.prompt_len == 4 and len(sample.messages) == 3
        assert all(m["content"] for m in sample.messages)
    assert datasets.split_length(random.Random(0), 10, 1) == [10]
    sizes = datasets.split_length(random.Random(0), 10, 4)
    assert sum(sizes) == 10 and min(sizes) >= 1 and sizes[-1] == max(sizes)
    with pytest.raises(ValueError, match="parts"):
        datasets.split_length(random.Random(0), 3, 4)


async def test_a_refused_model_list_is_reported_with_its_status(aiohttp_client):
    """A wrong --api-key: the 401 is named (it read as a body without "data")."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad key"}}, status=401)

    app = web.Application()
    app.router.add_get("/v1/models", refuse)
    client = await aiohttp_client(app)
    with pytest.raises(serve.BenchError, match=r"answered 401: .*bad key"):
        await serve.resolve_model(client.session, str(client.make_url("/v1")), {})
