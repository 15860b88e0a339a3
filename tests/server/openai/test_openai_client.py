"""The official `openai` client against a live server (AppRunner + TCPSite on 127.0.0.1)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from aioinfer.config import ServerConfig
from tests.server.conftest import (
    API_KEYS,
    MAX_MODEL_LEN,
    MODEL,
    assert_pool_free,
    chat_prompt_ids,
    expected_output,
    fake_logprobs,
    text_prompt_ids,
)
from tests.support.tokenizers import make_tokenizer

MESSAGES = [{"role": "user", "content": "Hello, world! How are you today?"}]


async def test_models_list(oai):
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_MODEL_LEN


async def test_completion(oai):
    result = await oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7)
    ids = text_prompt_ids("The quick brown fox")
    assert result.choices[0].text == expected_output(ids, 7)[1]
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 7)


async def test_chat_completion_n2_and_seed(oai):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "n": 2, "seed": 11,
              "temperature": 0.7}  # fmt: skip
    first = await oai.chat.completions.create(**kwargs)
    again = await oai.chat.completions.create(**kwargs)
    expected = expected_output(chat_prompt_ids(MESSAGES), 6)[1]
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [expected, expected]
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    assert first.choices[0].message.role == "assistant"
    assert first.usage.completion_tokens == 12


async def test_streaming_chat_with_usage(oai):
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
    ids = chat_prompt_ids(MESSAGES)
    assert text == expected_output(ids, 5)[1] and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(ids), 5, len(ids) + 5,
    )  # fmt: skip


async def test_streaming_completion_equals_non_streaming(oai):
    kwargs = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 10, "seed": 3}
    whole = await oai.completions.create(**kwargs)
    stream = await oai.completions.create(**kwargs, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream])
    assert text == whole.choices[0].text == expected_output([7, 8, 9], 10)[1]


async def test_stop_strings(oai):
    _, full = expected_output([20, 21], 20)
    stop = full[4:6]
    result = await oai.completions.create(model=MODEL, prompt=[20, 21], max_tokens=20, stop=stop)
    choice = result.choices[0]
    assert choice.text == full[: full.index(stop)] and choice.finish_reason == "stop"
    assert choice.stop_reason == stop  # a vLLM extension the client keeps as an extra field


async def test_logprobs(oai):
    result = await oai.completions.create(model=MODEL, prompt=[7, 8], max_tokens=3, logprobs=1)
    out_ids, _ = expected_output([7, 8], 3)
    tok = make_tokenizer()
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == [tok.decode([t]) for t in out_ids]
    assert logprobs.token_logprobs == pytest.approx([fake_logprobs(t, 1).logprob for t in out_ids])
    chat = await oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    out_ids, _ = expected_output(chat_prompt_ids(MESSAGES), 3)
    assert [c.token for c in content] == [tok.decode([t]) for t in out_ids]
    assert [len(c.top_logprobs) for c in content] == [3, 3, 3]


async def test_extra_sampling_fields_pass_through(oai):
    result = await oai.completions.create(
        model=MODEL,
        prompt=[7, 8],
        max_tokens=4,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True,
                    "min_tokens": 2, "skip_special_tokens": False},
    )  # fmt: skip
    assert result.usage.completion_tokens == 4


async def test_bad_input_raises_the_right_exception(oai):
    with pytest.raises(openai.BadRequestError) as info:
        await oai.completions.create(model=MODEL, prompt="a", temperature=-1)
    assert "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError, match="suffix"):
        await oai.completions.create(model=MODEL, prompt="a", suffix="b")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
        await oai.completions.create(model=MODEL, prompt=[5] * 200)
    with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
        await oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    with pytest.raises(openai.NotFoundError) as info:
        await oai.chat.completions.create(model="not-a-model", messages=MESSAGES)
    assert info.value.body["param"] == "model"


async def test_api_keys_required_and_accepted(live_factory, engine):
    server = await live_factory(engine, ServerConfig(api_key=API_KEYS))
    for key in ("wrong", ""):
        client = server.openai(api_key=key or "x")
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
        await client.close()
    for key in API_KEYS:
        client = server.openai(api_key=key)
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        await client.close()


async def test_64_concurrent_streams(oai, engine):
    async def one(i: int) -> tuple[list[dict], str]:
        messages = [{"role": "user", "content": f"request number {i}"}]
        stream = await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True
        )
        text = "".join([(c.choices[0].delta.content or "") async for c in stream if c.choices])
        return messages, text

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 20)
    for messages, text in results:
        assert text == expected_output(chat_prompt_ids(messages), 8)[1]
    assert_pool_free(engine)
