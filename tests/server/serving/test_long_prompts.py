"""Long texts are tokenized on a worker thread, not on the event loop that streams everyone
else's tokens, with the same result (the test model's context is far shorter than these texts,
so generation requests end in the context-length 400, reached through the same path)."""

from __future__ import annotations

import threading

import orjson

from aioinfer.server.http.work_queue import OFF_LOOP
from aioinfer.server.serving import prompts
from tests.server.conftest import MAX_MODEL_LEN, text_prompt_ids
from tests.server.test_http import error_of, post
from tests.support.tokenizers import make_tokenizer

LONG = "The quick brown fox jumps over the lazy dog. " * 1000  # 45,000 characters


def count_threads(monkeypatch) -> list[str]:
    """The names of the functions sent to OFF_LOOP's threads, as they are sent."""
    calls: list[str] = []
    submit = OFF_LOOP.submit

    def counting(fn, *args):
        calls.append(getattr(fn, "__name__", type(fn).__name__))
        return submit(fn, *args)

    monkeypatch.setattr(OFF_LOOP, "submit", counting)
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


def tool_calls(arguments: str) -> list[dict]:
    """A short chat whose assistant turn called a tool with `arguments` (JSON text)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


async def test_a_chat_renders_off_the_loop_when_its_body_is_large_whatever_its_text(
    client, monkeypatch
):
    """Short messages once decided it: tools, documents or a tool call's arguments of
    megabytes were rendered (and the arguments parsed) on the loop."""
    from aioinfer.server.serving import protocol

    calls = count_threads(monkeypatch)
    converted_on: list[str] = []
    to_template = protocol.ChatMessage.to_template

    def recording(self):
        converted_on.append(threading.current_thread().name)
        return to_template(self)

    monkeypatch.setattr(protocol.ChatMessage, "to_template", recording)
    arguments = orjson.dumps({f"k{i}": i for i in range(3000)}).decode()  # 30 KB
    body = {"messages": tool_calls(arguments), "max_tokens": 1}
    for path in ("/tokenize", "/v1/chat/completions"):
        response, raw = await post(client, path, body)
        assert response.status in (200, 400), raw  # a prompt past the context: the 400 after
        assert calls[-1] == "render_chat"
    assert converted_on and threading.main_thread().name not in converted_on
    # A small body renders on the loop: what the template sees is bounded by the body.
    converted_on.clear()
    _, raw = await post(client, "/tokenize", {"messages": tool_calls('{"a": 1}')})
    assert orjson.loads(raw)["count"] > 0 and converted_on == [threading.main_thread().name] * 3


async def test_what_the_template_would_see_is_bounded_before_rendering(client, monkeypatch):
    """Megabytes of tools, documents or arguments behind a short message: a 400 naming the
    field, without rendering or tokenizing (the prompt-length 400 came after seconds of both)."""
    from aioinfer.engine import tokenizer as tokenizer_module

    def no_render(*args, **kwargs):
        raise AssertionError("rendered")

    monkeypatch.setattr(tokenizer_module, "apply_chat_template", no_render)
    limit = prompts.template_char_limit(MAX_MODEL_LEN)
    description = "d" * 1000
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": description}}
        for i in range(limit // 1000 + 1)
    ]
    short = [{"role": "user", "content": "hi"}]
    documents = [{"title": "t", "text": "x" * (limit // 4)}] * 5
    arguments = orjson.dumps({"a": "x" * (limit + 1)}).decode()
    for path in ("/tokenize", "/v1/chat/completions"):
        for body, param in (
            ({"messages": short, "tools": tools, "tool_choice": "none"}, "tools"),
            ({"messages": short, "documents": documents}, "documents"),
            ({"messages": tool_calls(arguments)}, "messages"),
        ):
            _, raw = await post(client, path, body)
            error = error_of(raw, 400)
            assert error["param"] == param, error
            assert f"at most {limit} are allowed" in error["message"]
