"""Scoring a prompt: /v1/completions with echo and max_tokens 0 (what evaluation harnesses send
for log-likelihoods) returns the prompt and its logprobs and generates nothing."""

from __future__ import annotations

import orjson
import pytest

from tests.server.conftest import assert_pool_free, fake_logprobs
from tests.server.test_http import chunks_of, error_of, post
from tests.support.tokenizers import make_tokenizer

PROMPTS = [[40, 41, 42, 43], [7, 8, 9]]
SCORE = {"prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 1}


async def test_echo_with_max_tokens_0_returns_the_scored_prompt_only(client, engine):
    _, raw = await post(client, "/v1/completions", SCORE)
    body = orjson.loads(raw)
    tok = make_tokenizer()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, prompt in zip(body["choices"], PROMPTS, strict=True):
        assert choice["text"] == tok.decode(prompt)
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [tok.decode([t]) for t in prompt]
        expected = [None] + [fake_logprobs(t, 1).logprob for t in prompt[1:]]
        assert logprobs["token_logprobs"] == pytest.approx(expected)
    usage = body["usage"]
    assert usage["completion_tokens"] == 0
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(map(len, PROMPTS))
    assert_pool_free(engine)


async def test_scoring_streamed_equals_scoring_whole(client):
    _, raw = await post(client, "/v1/completions", SCORE)
    whole = {c["index"]: c for c in orjson.loads(raw)["choices"]}
    _, raw = await post(client, "/v1/completions", {**SCORE, "stream": True})
    text = {i: "" for i in whole}
    tokens: dict[int, list[str]] = {i: [] for i in whole}
    reasons = {}
    for chunk in chunks_of(raw):
        for choice in chunk["choices"]:
            text[choice["index"]] += choice["text"]
            if choice["logprobs"]:
                tokens[choice["index"]] += choice["logprobs"]["tokens"]
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    for index, choice in whole.items():
        assert text[index] == choice["text"]
        assert tokens[index] == choice["logprobs"]["tokens"]
    assert reasons == {0: "length", 1: "length"}


async def test_max_tokens_0_without_echo_is_still_refused(client):
    _, raw = await post(client, "/v1/completions", {"prompt": [5, 6], "max_tokens": 0})
    assert error_of(raw, 400)["param"] == "max_tokens"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    _, raw = await post(client, "/v1/chat/completions", body)
    assert error_of(raw, 400)["param"] == "max_tokens"
