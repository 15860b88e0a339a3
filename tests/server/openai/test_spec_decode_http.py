"""--speculative-config behind the HTTP API: a step may emit several tokens, and every API shape
(streamed text, token ids, logprobs, usage, stop strings) still reads as one token at a time;
the spec_decode counters appear in /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from tests.server.conftest import assert_pool_free, build_engine, fake_logprobs
from tests.server.test_http import chunks_of, post
from tests.support.fake_runner import reference_output, repeating_next_token
from tests.support.tokenizers import make_tokenizer

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip
PROMPT_IDS = [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41]


@pytest.fixture
async def spec_engine() -> AsyncIterator[AsyncEngine]:
    engine = await build_engine(next_token=repeating_next_token, speculative_config=SPEC)
    yield engine
    await engine.shutdown()


@pytest.fixture
async def spec_client(aiohttp_client: Callable[..., Any], spec_engine: AsyncEngine) -> Any:
    return await aiohttp_client(create_app(spec_engine, ServerConfig()))


def expected(max_tokens: int) -> tuple[list[int], str]:
    ids = reference_output(PROMPT_IDS, max_tokens, next_token=repeating_next_token)
    return ids, make_tokenizer().decode(ids, skip_special_tokens=True)


async def test_streamed_and_whole_completions_read_one_token_at_a_time(spec_client, spec_engine):
    body = {"prompt": PROMPT_IDS, "max_tokens": 30, "logprobs": 2, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    ids, text = expected(30)
    _, raw = await post(spec_client, "/v1/completions", body)
    reply = orjson.loads(raw)
    (choice,) = reply["choices"]
    assert choice["token_ids"] == ids and choice["text"] == text
    assert len(choice["logprobs"]["tokens"]) == 30
    assert choice["logprobs"]["token_logprobs"] == [fake_logprobs(t, 2).logprob for t in ids]
    assert reply["usage"]["completion_tokens"] == 30

    body |= {"stream": True, "stream_options": {"include_usage": True}}
    _, raw = await post(spec_client, "/v1/completions", body)
    chunks = chunks_of(raw)
    streamed_ids, streamed_text, streamed_logprobs = [], "", []
    for chunk in chunks:
        for c in chunk["choices"]:
            streamed_ids += c.get("token_ids", [])
            streamed_text += c["text"]
            streamed_logprobs += (c.get("logprobs") or {}).get("token_logprobs", [])
    assert streamed_ids == ids and streamed_text == text
    assert streamed_logprobs == [fake_logprobs(t, 2).logprob for t in ids]
    assert chunks[-1]["usage"]["completion_tokens"] == 30
    # Fewer content chunks than tokens: drafts were accepted.
    assert len([c for c in chunks if c["choices"]]) < 30
    assert spec_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_pool_free(spec_engine)


async def test_a_stop_string_inside_accepted_drafts_cuts_the_text_there(spec_client):
    _, text = expected(30)
    # A stop string that first appears in the middle of the output.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.index(stop)]
    body = {"prompt": PROMPT_IDS, "max_tokens": 30, "stop": [stop], "ignore_eos": True}
    _, raw = await post(spec_client, "/v1/completions", body)
    (choice,) = orjson.loads(raw)["choices"]
    assert choice["text"] == cut
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


async def test_metrics_count_drafts(spec_client):
    await post(spec_client, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 20})
    resp = await spec_client.get("/metrics")
    metrics = await resp.text()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("aioinfer:spec_decode") and "per_pos" not in line
    }
    assert values["aioinfer:spec_decode_num_drafts_total"] > 0
    drafted = values["aioinfer:spec_decode_num_draft_tokens_total"]
    accepted = values["aioinfer:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    # One inter-token gap per step that gave tokens (as vLLM's), not one per token: 20
    # tokens in 20 - accepted steps.
    itl = next(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("aioinfer:inter_token_latency_seconds_count")
    )
    assert itl == 20 - accepted - 1
    assert (
        'aioinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="fake-model",position="0"}'
        in metrics
    )
