"""vLLM's return_token_ids (the prompt's and the output's token ids beside the text, whole or
streamed: each chunk its own ids, the prompt's once) and prompt_logprobs."""

from __future__ import annotations

import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from tests.server.conftest import (
    build_engine,
    chat_prompt_ids,
    expected_output,
    fake_logprobs,
    text_prompt_ids,
)
from tests.server.test_http import MESSAGES, chunks_of, error_of, post
from tests.support.tokenizers import make_bos_tokenizer, make_tokenizer

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


async def test_completions_add_the_bos_unless_told_not_to(aiohttp_client):
    """vLLM's add_special_tokens: a prompt that already holds its BOS (a chat rendered by the
    client) must not get a second one."""
    tok = make_bos_tokenizer()
    engine = await build_engine(tokenizer=tok)
    try:
        client = await aiohttp_client(create_app(engine, ServerConfig()))
        bos, text = tok.bos_token, "Hello"
        plain = tok.encode(text, add_special_tokens=False)
        for body, expected in (
            ({"prompt": text}, [tok.bos_token_id, *plain]),
            ({"prompt": bos + text, "add_special_tokens": False}, [tok.bos_token_id, *plain]),
            ({"prompt": [text, text], "add_special_tokens": False}, plain),
        ):
            body |= {"max_tokens": 1, "return_token_ids": True}
            _, raw = await post(client, "/v1/completions", body)
            for choice in orjson.loads(raw)["choices"]:
                assert choice["prompt_token_ids"] == expected, body
        resp, raw = await post(
            client, "/v1/completions", {"prompt": text, "add_special_tokens": "no"}
        )
        assert resp.status == 400 and error_of(raw, 400)["param"] == "add_special_tokens"
    finally:
        await engine.shutdown()


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


async def test_prompt_logprobs_in_vllm_s_shape(client):
    prompt = [5, 17, 99, 250]
    body = {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}
    _, raw = await post(client, "/v1/completions", body)
    entries = orjson.loads(raw)["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    tokenizer = make_tokenizer()
    for token, entry in zip(prompt[1:], entries[1:], strict=True):
        want = fake_logprobs(token, 2)  # what the fake runner reports for this target
        assert entry[str(token)] == {
            "logprob": pytest.approx(want.logprob),
            "rank": want.rank,
            "decoded_token": tokenizer.decode([token]),
        }
        for rank, (alt, logprob) in enumerate(want.top, start=1):
            assert entry[str(alt)]["rank"] == rank
            assert entry[str(alt)]["logprob"] == pytest.approx(logprob)
    chat = {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}
    _, raw = await post(client, "/v1/chat/completions", chat)
    entries = orjson.loads(raw)["prompt_logprobs"]
    assert len(entries) == len(chat_prompt_ids(MESSAGES)) and entries[0] is None
    assert all(len(e) == 1 for e in entries[1:])
    _, raw = await post(client, "/v1/completions", {**body, "stream": True})
    assert error_of(raw, 400)["param"] == "prompt_logprobs"


async def test_echoed_logprobs_and_prompt_logprobs_keep_their_own_widths(client):
    """The engine computes the prompt's logprobs as wide as the wider request; each answer
    shows what it asked for."""
    body = {"prompt": "The quick brown fox", "max_tokens": 1, "echo": True}
    _, raw = await post(client, "/v1/completions", {**body, "logprobs": 3, "prompt_logprobs": 0})
    choice = orjson.loads(raw)["choices"][0]
    assert [len(e) for e in choice["prompt_logprobs"][1:]] == [1, 1, 1]
    assert all(len(top) == 4 for top in choice["logprobs"]["top_logprobs"][1:])
    _, raw = await post(client, "/v1/completions", {**body, "logprobs": 0, "prompt_logprobs": 4})
    choice = orjson.loads(raw)["choices"][0]
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(e) == 5 for e in choice["prompt_logprobs"][1:])
