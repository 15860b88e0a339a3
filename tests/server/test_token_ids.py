"""vLLM's return_token_ids: the prompt's and the output's token ids beside the text, whole or
streamed (each chunk its own ids, the prompt's once)."""

from __future__ import annotations

import orjson
import pytest

from tests.server.conftest import chat_prompt_ids, expected_output, text_prompt_ids
from tests.server.test_http import MESSAGES, chunks_of, post

PROMPT = "The quick brown fox"


async def test_completions_return_token_ids(client):
    body = {"prompt": [PROMPT, "Hello"], "max_tokens": 5, "n": 2, "return_token_ids": True}
    _, raw = await post(client, "/v1/completions", body)
    choices = orjson.loads(raw)["choices"]
    assert len(choices) == 4
    for choice in choices:
        prompt_ids = text_prompt_ids([PROMPT, "Hello"][choice["index"] // 2])
        assert choice["prompt_token_ids"] == prompt_ids
        assert choice["token_ids"] == expected_output(prompt_ids, 5)[0]
    _, raw = await post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert "token_ids" not in orjson.loads(raw)["choices"][0]  # only when asked


async def test_streamed_completions_carry_each_chunk_s_ids_and_the_prompt_s_once(client):
    body = {"prompt": PROMPT, "max_tokens": 7, "stream": True, "return_token_ids": True}
    _, raw = await post(client, "/v1/completions", body)
    ids, prompts = [], []
    for chunk in chunks_of(raw):
        (choice,) = chunk["choices"]
        ids += choice.get("token_ids", [])
        if "prompt_token_ids" in choice:
            prompts.append(choice["prompt_token_ids"])
    prompt_ids = text_prompt_ids(PROMPT)
    assert prompts == [prompt_ids]
    assert ids == expected_output(prompt_ids, 7)[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_returns_token_ids(client, stream):
    body = {"messages": MESSAGES, "max_tokens": 6, "return_token_ids": True, "stream": stream}
    _, raw = await post(client, "/v1/chat/completions", body)
    prompt_ids = chat_prompt_ids(MESSAGES)
    expected = expected_output(prompt_ids, 6)[0]
    if not stream:
        reply = orjson.loads(raw)
        assert reply["prompt_token_ids"] == prompt_ids
        assert reply["choices"][0]["token_ids"] == expected
        return
    chunks = chunks_of(raw)
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [prompt_ids]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == expected
