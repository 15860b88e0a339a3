"""/metrics through aiohttp's test client, parsed with prometheus_client's parser: exact values
against the fake model's outputs."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioinfer.server.app import create_app
from tests.server.conftest import MODEL, assert_pool_free, build_engine, chat_prompt_ids

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello, world! How are you today?"},
]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client) -> Samples:
    """Every sample of /metrics by (name without the prefix, labels other than model_name)."""
    response = await client.get("/metrics")
    assert response.status == 200
    samples: Samples = {}
    for family in text_string_to_metric_families((await response.read()).decode()):
        for sample in family.samples:
            assert sample.labels.get("model_name", MODEL) == MODEL
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name.removeprefix("aioinfer:"), labels)] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def post(client, path, body):
    response = await client.post(path, json=body)
    return response.status, await response.read()


async def test_metrics(aiohttp_client, client, engine):
    other = await aiohttp_client(create_app(engine))  # a second app: its own registry
    body = {"prompt": [5, 6, 7], "max_tokens": 5, "stream": True}
    await post(client, "/v1/completions", body)
    await post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    samples = await scrape(client)
    assert value(samples, "num_requests_running") == 0
    assert value(samples, "num_requests_waiting") == 0
    assert value(samples, "kv_cache_usage_perc") == 0
    assert value(samples, "prompt_tokens_total") == 3 + len(chat_prompt_ids(MESSAGES))
    assert value(samples, "generation_tokens_total") == 8
    assert value(samples, "request_success_total", finished_reason="length") == 2
    assert value(samples, "time_to_first_token_seconds_count") == 2
    assert value(samples, "e2e_request_latency_seconds_count") == 2
    assert value(samples, "inter_token_latency_seconds_count") == 6
    assert value(samples, "prefix_cache_queries_total") == engine.scheduler.kv.stats.queries
    assert ("prefix_cache_hits_total", ()) in samples
    # Read from the engine: every app over it shows the same numbers.
    assert value(await scrape(other), "time_to_first_token_seconds_count") == 2


async def test_process_series_and_cache_config_as_vllm_exports_them(client, engine):
    """The process_*, python_gc_* and python_info series of the default registry that vLLM's
    metrics live in, and vLLM's cache_config_info: the cache's settings as labels."""
    response = await client.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families((await response.read()).decode())}
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert "python_gc_collections" in families and "python_info" in families
    (info,) = families["aioinfer:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == str(engine.cache_config.block_size)
    assert info.labels["num_gpu_blocks"] == str(engine.scheduler.kv.pool.num_blocks)
    assert info.labels["enable_prefix_caching"] == "True"


async def test_series_exist_at_zero_before_the_first_event(client):
    """As vLLM creates them: a rate() over a series that appears with its first event misses
    that event."""
    samples = await scrape(client)
    for reason in ("stop", "length", "abort"):
        assert value(samples, "request_success_total", finished_reason=reason) == 0
    for reason in ("client_disconnect", "queue_timeout", "shutdown"):
        assert value(samples, "request_aborted_total", reason=reason) == 0
    assert value(samples, "request_rejected_total", reason="queue_full") == 0
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_params_n", "iteration_tokens_total"):  # fmt: skip
        assert value(samples, f"{name}_count") == 0
        assert value(samples, f"{name}_bucket", le="+Inf") == 0


async def test_n_sequences_are_observed_each(client):
    """As vLLM's child requests: each of n sequences has its latencies, its token counts and
    its finish reason; the n parameter is observed once per request."""
    status, _ = await post(
        client, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "n": 3}
    )
    assert status == 200
    samples = await scrape(client)
    assert value(samples, "request_success_total", finished_reason="length") == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):  # fmt: skip
        assert value(samples, f"{name}_count") == 3, name
    assert value(samples, "inter_token_latency_seconds_count") == 3 * 3
    assert value(samples, "request_generation_tokens_count") == 3
    assert value(samples, "request_generation_tokens_sum") == 3 * 4
    assert value(samples, "request_params_n_count") == 1
    assert value(samples, "request_params_n_sum") == 3
    assert value(samples, "request_params_n_bucket", le="2.0") == 0
    assert value(samples, "request_params_n_bucket", le="5.0") == 1


# --------------------------------------------------------------------------- request phases


async def test_request_phase_and_size_histograms(aiohttp_client):
    """vLLM's per-request histograms, from the request's timestamps: queued, first scheduled,
    first token, finished. One request runs at a time, each step takes 20 ms or more."""
    engine = await build_engine(step_delay=0.02, max_num_seqs=1)
    try:
        client = await aiohttp_client(create_app(engine))
        bodies = [{"prompt": [5, 6, 7], "max_tokens": 5}, {"prompt": [8, 9], "max_tokens": 3}]
        results = await asyncio.gather(*(post(client, "/v1/completions", b) for b in bodies))
        assert [status for status, _ in results] == [200, 200]
        samples = await scrape(client)
    finally:
        await engine.shutdown()
    assert value(samples, "request_prompt_tokens_sum") == 3 + 2
    assert value(samples, "request_prompt_tokens_bucket", le="2.0") == 1
    assert value(samples, "request_prompt_tokens_bucket", le="5.0") == 2
    assert value(samples, "request_generation_tokens_sum") == 5 + 3
    assert value(samples, "request_params_max_tokens_sum") == 5 + 3
    # Buckets of token counts go 1, 2, 5, ... up to the context (128).
    assert value(samples, "request_params_max_tokens_bucket", le="100.0") == 2
    assert ("request_params_max_tokens_bucket", (("le", "200.0"),)) not in samples
    # Steps feed each prompt whole, then one token per decode step: eight steps in all.
    assert value(samples, "iteration_tokens_total_count") == 5 + 3
    assert value(samples, "iteration_tokens_total_sum") == (3 + 4) + (2 + 2)
    assert value(samples, "iteration_tokens_total_bucket", le="1.0") == 4 + 2
    seconds = {
        name: value(samples, f"request_{name}_time_seconds_sum")
        for name in ("queue", "prefill", "decode", "inference")
    }
    e2e = value(samples, "e2e_request_latency_seconds_sum")
    assert seconds["queue"] + seconds["inference"] == pytest.approx(e2e)
    assert seconds["prefill"] + seconds["decode"] == pytest.approx(seconds["inference"])
    # The second waits for the first's five steps; the prefills take a step each, the decodes
    # the remaining 4 + 2 steps.
    assert seconds["queue"] >= 4 * 0.02  # less the moment between the two arrivals
    assert seconds["prefill"] >= 2 * 0.02
    assert seconds["decode"] >= 6 * 0.02
    assert value(samples, "inter_token_latency_seconds_sum") >= 6 * 0.02


# --------------------------------------------------------------------------- prompt tokens


async def test_prompt_tokens_count_prefilled_prompts_only(aiohttp_client):
    """Counted once the prompt is prefilled (vLLM's point): not for prompts queued and then
    refused with the rest of their batch, nor for a request that timed out in the queue; once
    for a request preempted and computed again."""
    engine = await build_engine(step_delay=0.02, max_num_seqs=1, queue_timeout=0.2)
    try:
        client = await aiohttp_client(create_app(engine))
        # The third prompt does not fit: the two queued before it are aborted with it.
        too_long = {"prompt": [[5, 6, 7], [8, 9, 10, 11], [5] * 200], "max_tokens": 3}
        assert (await post(client, "/v1/completions", too_long))[0] == 400
        assert value(await scrape(client), "prompt_tokens_total") == 0
        # max_num_seqs 1: the second request waits behind the first and times out.
        first = asyncio.create_task(
            post(client, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 30})
        )
        while engine.scheduler.num_running < 1:
            await asyncio.sleep(0.005)
        second = await post(client, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 3})
        assert second[0] == 503 and (await first)[0] == 200
        samples = await scrape(client)
        assert value(samples, "prompt_tokens_total") == 3
        assert value(samples, "request_aborted_total", reason="queue_timeout") == 1
    finally:
        await engine.shutdown()
    engine = await build_engine(num_blocks=12)
    try:
        samples = await preempted_requests(await aiohttp_client(create_app(engine)))
        assert value(samples, "prompt_tokens_total") == 4 * 8
        assert_pool_free(engine)
    finally:
        await engine.shutdown()


async def preempted_requests(client) -> Samples:
    """Four requests of twenty tokens (prompts of eight that share no block) on twelve blocks
    of four tokens: some are preempted. The metrics after."""
    bodies = [{"prompt": [5 + i, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 12} for i in range(4)]
    results = await asyncio.gather(*(post(client, "/v1/completions", b) for b in bodies))
    assert [status for status, _ in results] == [200] * 4
    samples = await scrape(client)
    assert value(samples, "num_preemptions_total") > 0
    return samples


# --------------------------------------------------------------------------- prefix cache


async def test_prefix_cache_counters_count_first_lookups_only(aiohttp_client):
    """As vLLM's: a request whose prompt logprobs need every token computed makes no lookup
    (no query), and a preempted request finding its own blocks again is not a hit."""
    engine = await build_engine(num_blocks=12)
    try:
        client = await aiohttp_client(create_app(engine))
        body = {"prompt": list(range(5, 30)), "max_tokens": 2, "prompt_logprobs": 1}
        for _ in range(2):
            assert (await post(client, "/v1/completions", body))[0] == 200
        samples = await scrape(client)
        assert value(samples, "prefix_cache_queries_total") == 0
        assert value(samples, "prefix_cache_hits_total") == 0
        # The same prompt without prompt logprobs, twice: the second finds six full blocks
        # (one token is always left to compute).
        del body["prompt_logprobs"]
        for _ in range(2):
            assert (await post(client, "/v1/completions", body))[0] == 200
        samples = await scrape(client)
        assert value(samples, "prefix_cache_queries_total") == 2 * 25
        assert value(samples, "prefix_cache_hits_total") == 6 * 4
    finally:
        await engine.shutdown()
    engine = await build_engine(num_blocks=12)
    try:
        samples = await preempted_requests(await aiohttp_client(create_app(engine)))
        assert value(samples, "prefix_cache_queries_total") == 4 * 8
        assert value(samples, "prefix_cache_hits_total") == 0
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------- echo, max_tokens 0


async def test_echo_with_max_tokens_0_counts_no_generated_token(client):
    """The engine samples one token the client never sees: neither the counters nor TTFT count
    it; the prompt and the finished request count."""
    body = {"prompt": [5, 6, 7], "max_tokens": 0, "echo": True}
    status, raw = await post(client, "/v1/completions", body)
    assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 0
    samples = await scrape(client)
    assert value(samples, "generation_tokens_total") == 0
    assert value(samples, "prompt_tokens_total") == 3
    assert value(samples, "time_to_first_token_seconds_count") == 0
    assert value(samples, "request_generation_tokens_count") == 1
    assert value(samples, "request_generation_tokens_sum") == 0
    assert value(samples, "request_params_max_tokens_sum") == 0
    assert value(samples, "e2e_request_latency_seconds_count") == 1
    assert value(samples, "request_success_total", finished_reason="length") == 1
