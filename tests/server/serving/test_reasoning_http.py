"""--reasoning-parser: a thinking model's `<think>` block comes back in `reasoning`, apart from
the answer, streamed or not, through the official client. The tiny random Llama is made to
write such an output with a one-choice constraint (its vocabulary has no single-token tags, so
the grammar is not held back)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from transformers import AutoTokenizer

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from aioinfer.engine.async_engine import AsyncEngine
from tests.server.serving.test_tools_http import TOOLS
from tests.server.test_http import post
from tests.support.tiny_models import make_hf_model
from tests.support.tokenizers import CHAT_TEMPLATE, make_tokenizer

HELLO = [{"role": "user", "content": "Hi"}]  # leaves room for the outputs below


async def _chat(server: Any, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """The reasoning, content, tool calls and finish_reason of one choice, put together from
    the chunks when streamed."""
    oai = server.openai()
    kwargs = {"messages": HELLO, **kwargs}
    kwargs["model"] = (await oai.models.list()).data[0].id
    if not stream:
        choice = (await oai.chat.completions.create(**kwargs)).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        out = {
            "reasoning": getattr(choice.message, "reasoning", None),
            "content": choice.message.content,
            "calls": calls,
            "finish": choice.finish_reason,
        }
    else:
        reasoning, content, calls, finish = None, None, [], None
        async for chunk in await oai.chat.completions.create(**kwargs, stream=True):
            for delta_choice in chunk.choices:
                delta = delta_choice.delta
                if getattr(delta, "reasoning", None):
                    reasoning = (reasoning or "") + delta.reasoning  # type: ignore[attr-defined]
                if delta.content:
                    content = (content or "") + delta.content
                for call in delta.tool_calls or []:
                    calls.append((call.function.name, call.function.arguments))
                finish = delta_choice.finish_reason or finish
        out = {"reasoning": reasoning, "content": content, "calls": calls, "finish": finish}
    await oai.close()
    return out


def _forced(text: str) -> dict[str, Any]:
    return {"extra_body": {"structured_outputs": {"choice": [text]}}}


@pytest.mark.parametrize("stream", [False, True])
async def test_qwen3_reasoning_comes_apart_from_the_answer(live_factory, real_engine, stream):
    server = await live_factory(real_engine, ServerConfig(reasoning_parser="qwen3"))
    out = await _chat(server, stream, **_forced("<think>\nThey greet me.\n</think>\n\nHello!"))
    assert out == {
        "reasoning": "They greet me.",
        "content": "Hello!",
        "calls": [],
        "finish": "stop",
    }
    # Without a block, all of it is the answer.
    out = await _chat(server, stream, **_forced("Hello there"))
    assert (out["reasoning"], out["content"]) == (None, "Hello there")


@pytest.mark.parametrize("stream", [False, True])
async def test_include_reasoning_false_drops_it(live_factory, real_engine, stream):
    server = await live_factory(real_engine, ServerConfig(reasoning_parser="qwen3"))
    forced = _forced("<think>Secret.</think>Hello!")
    forced["extra_body"]["include_reasoning"] = False
    out = await _chat(server, stream, **forced)
    assert (out["reasoning"], out["content"]) == (None, "Hello!")


@pytest.mark.parametrize("stream", [False, True])
async def test_deepseek_r1_output_starts_as_reasoning(live_factory, real_engine, stream):
    server = await live_factory(real_engine, ServerConfig(reasoning_parser="deepseek_r1"))
    out = await _chat(server, stream, **_forced("They greet me.</think>Hello!"))
    assert (out["reasoning"], out["content"]) == ("They greet me.", "Hello!")
    # Cut short while thinking: all reasoning, no answer.
    out = await _chat(server, stream, max_tokens=3, **_forced("They greet me.</think>Hello!"))
    assert out["reasoning"] and out["content"] is None and out["finish"] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_continuing_an_open_block_continues_the_reasoning(live_factory, real_engine, stream):
    """continue_final_message on an assistant message that opened `<think>` and did not close
    it: the output starts inside the block; one that closed it: the output is answer."""
    server = await live_factory(real_engine, ServerConfig(reasoning_parser="qwen3"))
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    opened = [*HELLO, {"role": "assistant", "content": "<think>\nThey greet"}]
    forced = _forced(" me.\n</think>\n\nHello!")
    forced["extra_body"] |= cont
    out = await _chat(server, stream, messages=opened, **forced)
    assert (out["reasoning"], out["content"]) == ("me.", "Hello!")
    closed = [*HELLO, {"role": "assistant", "content": "<think>Hm.</think>Hel"}]
    forced = _forced("lo!")
    forced["extra_body"] |= cont
    out = await _chat(server, stream, messages=closed, **forced)
    assert (out["reasoning"], out["content"]) == (None, "lo!")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_tool_parser_reads_the_answer_after_the_reasoning(
    live_factory, real_engine, stream
):
    config = ServerConfig(reasoning_parser="qwen3", tool_call_parser="hermes")
    server = await live_factory(real_engine, config)
    text = '<think>A call.</think>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    out = await _chat(server, stream, tools=TOOLS, **_forced(text))
    assert out["reasoning"] == "A call."
    assert not out["content"] and out["finish"] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in out["calls"]] == [("get_time", {})]


async def test_without_the_parser_the_block_stays_in_the_content(real_oai, real_engine):
    oai, _ = real_oai
    reply = await oai.chat.completions.create(
        model=real_engine.model_name, messages=HELLO, **_forced("<think>Hm.</think>Hello!")
    )
    message = reply.choices[0].message
    assert message.content == "<think>Hm.</think>Hello!"
    assert getattr(message, "reasoning", None) is None


async def test_earlier_reasoning_reaches_the_template(client, engine, monkeypatch):
    """Under either name, as reasoning_content, which Qwen3's template reads."""
    template = (
        "{% for m in messages %}{{ m.role }}[{{ m.reasoning_content }}]{{ m.content }};{% endfor %}"
    )
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    for name in ("reasoning", "reasoning_content"):
        messages = [*HELLO, {"role": "assistant", "content": "Hello!", name: "They greet me."}]
        _, raw = await post(client, "/tokenize", {"messages": messages})
        expected = "user[]Hi;assistant[They greet me.]Hello!;"
        tokens = make_tokenizer().encode(expected, add_special_tokens=False)
        assert orjson.loads(raw)["tokens"] == tokens


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        ServerConfig(reasoning_parser="granite")


# ---- a model whose vocabulary has `<think>` and `</think>` as tokens, as Qwen3's does, and
# whose template opens the block in the prompt, as Qwen3's thinking releases do.


@pytest.fixture(scope="module")
def thinking_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-thinking")
    make_tokenizer().save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = CHAT_TEMPLATE.replace("assistant\\n", "assistant\\n<think>\\n")
    tokenizer.save_pretrained(path)
    make_hf_model("qwen3", vocab_size=len(tokenizer)).save_pretrained(path)
    return path


@pytest.fixture
async def thinking_engine(thinking_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = await AsyncEngine.create(
        ModelConfig(model=str(thinking_path), dtype="float32", max_model_len=128),
        CacheConfig(kv_cache_memory=0.01),
        SchedulerConfig(),
    )
    yield engine
    await engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_grammar_constrains_the_answer_after_the_reasoning(
    live_factory, thinking_engine, stream
):
    """The model (biased to close its block at once) reasons freely, then the choice holds.
    Were the grammar applied from the first token, "yes" or "no" would be all reasoning."""
    end = thinking_engine.tokenizer.convert_tokens_to_ids("</think>")
    server = await live_factory(thinking_engine, ServerConfig(reasoning_parser="qwen3"))
    body = {"structured_outputs": {"choice": ["yes", "no"]}}
    out = await _chat(server, stream, logit_bias={str(end): 100}, extra_body=body)
    assert out["reasoning"] is None and out["content"] in ("yes", "no")
    assert out["finish"] == "stop"


async def test_the_responses_api_returns_the_reasoning_as_an_item(live_factory, thinking_engine):
    """The same greedy output through chat and through /v1/responses, streamed and not: the
    template opens the block, so the random model's output is reasoning."""
    server = await live_factory(thinking_engine, ServerConfig(reasoning_parser="qwen3"))
    chat = await _chat(server, False, max_tokens=12, temperature=0)
    assert chat["reasoning"] and chat["content"] is None
    oai = server.openai()
    kwargs: dict[str, Any] = {
        "model": thinking_engine.model_name,
        "input": "Hi",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    response = await oai.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == chat["reasoning"]  # type: ignore[union-attr,index]
    streamed = ""
    async for event in await oai.responses.create(**kwargs, stream=True):
        if event.type == "response.reasoning_text.delta":
            streamed += event.delta
    assert streamed == chat["reasoning"]
    await oai.close()


@pytest.mark.parametrize("close_at_once", [False, True])
async def test_usage_counts_the_reasoning_tokens(live_factory, thinking_engine, close_at_once):
    """completion_tokens_details.reasoning_tokens (chat, whole and streamed) and
    output_tokens_details.reasoning_tokens (Responses): the tokens before `</think>`. The
    template opens the block; the random model never closes it unless biased to at once."""
    end = thinking_engine.tokenizer.convert_tokens_to_ids("</think>")
    server = await live_factory(thinking_engine, ServerConfig(reasoning_parser="qwen3"))
    bias = {str(end): 100} if close_at_once else {}
    expected = 0 if close_at_once else 12
    oai = server.openai()
    kwargs: dict[str, Any] = {"model": thinking_engine.model_name, "messages": HELLO}
    kwargs |= {"max_tokens": 12, "temperature": 0, "logit_bias": bias}
    completion = await oai.chat.completions.create(**kwargs)
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    details = completion.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == expected
    chunks = [c async for c in await oai.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True})]  # fmt: skip
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == expected
    if not close_at_once:  # the Responses API has no logit_bias
        response = await oai.responses.create(
            model=thinking_engine.model_name, input="Hi", max_output_tokens=12, temperature=0
        )
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == expected
    await oai.close()
