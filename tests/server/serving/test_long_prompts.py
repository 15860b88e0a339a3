"""Long texts are tokenized on a worker thread, not on the event loop that streams everyone
else's tokens, with the same result (the test model's context is far shorter than these texts,
so generation requests end in the context-length 400, reached through the same path)."""

from __future__ import annotations

import asyncio

import orjson

from aioinfer.server.serving import prompts
from tests.server.conftest import MAX_MODEL_LEN, text_prompt_ids
from tests.server.test_http import error_of, post
from tests.support.tokenizers import make_tokenizer

LONG = "The quick brown fox jumps over the lazy dog. " * 1000  # 45,000 characters


def count_threads(monkeypatch) -> list[str]:
    calls: list[str] = []
    to_thread = asyncio.to_thread

    async def counting(fn, *args, **kwargs):
        calls.append(getattr(fn, "__name__", type(fn).__name__))
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(prompts.asyncio, "to_thread", counting)
    return calls


async def test_long_texts_are_tokenized_off_the_loop_with_the_same_ids(client, monkeypatch):
    calls = count_threads(monkeypatch)
    _, raw = await post(client, "/tokenize", {"prompt": LONG})
    assert orjson.loads(raw)["tokens"] == text_prompt_ids(LONG)
    messages = [{"role": "user", "content": LONG}]
    _, raw = await post(client, "/tokenize", {"messages": messages})
    expected = make_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert orjson.loads(raw)["tokens"] == list(expected)
    assert len(calls) == 2
    # Short texts stay on the loop.
    await post(client, "/tokenize", {"prompt": "short"})
    assert len(calls) == 2


async def test_long_generation_prompts_are_refused_after_tokenizing_off_the_loop(
    client, monkeypatch
):
    calls = count_threads(monkeypatch)
    _, raw = await post(client, "/v1/completions", {"prompt": LONG, "max_tokens": 1})
    assert f"maximum context length is {MAX_MODEL_LEN}" in error_of(raw, 400)["message"]
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1}
    _, raw = await post(client, "/v1/chat/completions", body)
    assert error_of(raw, 400)["param"] == "messages"
    assert len(calls) == 2


async def test_large_bodies_are_validated_off_the_loop(client, monkeypatch):
    """100k content parts take pydantic a while: not on the loop."""
    calls = count_threads(monkeypatch)
    parts = [{"type": "text", "text": "word"}] * 20_000  # about 700 KB of JSON
    _, raw = await post(client, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    assert orjson.loads(raw)["count"] > 20_000
    assert calls[0] == "parse"
