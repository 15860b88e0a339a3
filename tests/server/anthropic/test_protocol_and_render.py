"""The Messages API without a model: requests to chat requests, outputs to content blocks and
stream events, errors in Anthropic's envelope."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from aioinfer.core.outputs import CompletionOutput, RequestOutput
from aioinfer.server.anthropic.protocol import (
    MessagesRequest,
    MessageTokensCountRequest,
    messages_params,
)
from aioinfer.server.anthropic.render import MessageEvents, tool_input
from aioinfer.server.http.errors import anthropic_error_body
from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.serving.context import Prompt, ResponseContext
from aioinfer.server.serving.reasoning import ReasoningSplit
from aioinfer.server.serving.tool_parsers import HermesToolParser
from aioinfer.server.serving.tools import NamedToolChoice, ToolMode

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def context() -> ResponseContext:
    return ResponseContext("msg_1", "m", [Prompt([1, 2, 3])], 1, token_text=str)


def delta(
    text: str, finish: str | None = None, tokens: int = 1, stop: str | None = None
) -> RequestOutput:
    seq = CompletionOutput(0, text, [7] * tokens, finish_reason=finish, stop_reason=stop)
    return RequestOutput("msg_1", None, [1, 2, 3], [seq], finished=finish is not None)


def run(
    events: MessageEvents, texts: list[str], finish: str, stop: str | None = None
) -> list[dict[str, Any]]:
    """The whole stream of `texts` as deltas, the last one finishing with `finish`; each
    event is one Anthropic's client reads."""
    out: list[Any] = events.opening()
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        out += events.delta(0, delta(text, finish if last else None, stop=stop if last else None))
    out += events.closing()
    # The ping right after message_start is not among the client's event types: it skips it.
    pings = [i for i, event in enumerate(out) if event["type"] == "ping"]
    assert pings == [1] and out[0]["type"] == "message_start" and out[1] == {"type": "ping"}
    out = [event for event in out if event["type"] != "ping"]
    for event in out:
        EVENTS.validate_python(event)
    return out


def kinds(events: list[dict[str, Any]]) -> list[str]:
    """Event types, with the block kind that starts and the delta kind."""
    names = []
    for event in events:
        name = event["type"]
        if name == "content_block_start":
            name += ":" + event["content_block"]["type"]
        elif name == "content_block_delta":
            name = event["delta"]["type"]
        names.append(name)
    return names


def parse(**fields: Any) -> MessagesRequest:
    return MessagesRequest.parse({"max_tokens": 8, "messages": HI, **fields})


# --------------------------------------------------------------------------- requests


def test_turns_become_chat_messages_in_their_order():
    req = parse(
        system=[{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "A call.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "1"},
                {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                 "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "g"}]},
                {"type": "text", "text": "So?"},
            ]},
        ],
    )  # fmt: skip
    messages = [m.to_template() for m in req.to_chat().messages]
    calls = messages[2].pop("tool_calls")
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("t1", "f", {"x": 1}),
        ("t2", "g", {}),
    ]
    assert messages == [
        {"role": "system", "content": "A.\nB."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "reasoning": "A call.",
         "reasoning_content": "A call."},
        {"role": "tool", "content": "1", "tool_call_id": "t1"},
        {"role": "tool", "content": "no\ng", "tool_call_id": "t2"},
        {"role": "user", "content": "So?"},
    ]  # fmt: skip


def test_settings_become_the_chat_s():
    chat = parse(
        stop_sequences=["##"],
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        thinking={"type": "disabled"},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        metadata={"user_id": "u"},
        service_tier="auto",
    ).to_chat()
    assert chat.stop == ["##"] and chat.max_completion_tokens == 8
    assert (chat.temperature, chat.top_p, chat.top_k) == (0.5, 0.9, 5)
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == {"type": "object"}
    enabled = parse(thinking={"type": "enabled", "budget_tokens": 2048}).to_chat()
    assert enabled.chat_template_kwargs == {"enable_thinking": True}
    assert parse().to_chat().chat_template_kwargs is None


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        (None, None, True),
        ({"type": "auto"}, "auto", True),
        ({"type": "none"}, "none", True),
        ({"type": "any"}, "required", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "f"}, NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "f"}}), True),
    ],
)  # fmt: skip
def test_tool_choice_becomes_the_chat_s(choice, chat_choice, parallel):
    chat = parse(tools=[TOOL], tool_choice=choice).to_chat()
    assert chat.tool_choice == chat_choice and chat.parallel_tool_calls is parallel
    assert chat.tools is not None and chat.tools[0].function.parameters == {"type": "object"}
    # Without tools, auto and none are no choice at all.
    if choice is not None and choice["type"] in ("auto", "none"):
        assert parse(tool_choice=choice).to_chat().tool_choice is None


def test_errors_name_the_messages_field():
    with pytest.raises(RequestValidationError) as info:
        parse(messages=[{"role": "user", "content": [{"type": "text"}]}])
    assert info.value.param == "messages[0].content[0].text"
    assert ".blocks" not in info.value.message and ".text.text" not in info.value.message
    for chat_param, param in [("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"),
                              ("messages[3].content", "messages")]:  # fmt: skip
        with pytest.raises(RequestValidationError) as info, messages_params():
            raise RequestValidationError("x", chat_param)
        assert info.value.param == param
    with pytest.raises(RequestValidationError) as info:
        parse(tools=[TOOL, TOOL], tool_choice={"type": "any"}).to_chat()
    assert info.value.param == "tools"


def test_count_tokens_needs_no_max_tokens():
    req = MessageTokensCountRequest.parse({"messages": HI})
    assert req.max_tokens is None and req.to_chat().max_completion_tokens is None
    with pytest.raises(RequestValidationError) as info:
        MessagesRequest.parse({"messages": HI})
    assert info.value.param == "max_tokens"


# --------------------------------------------------------------------------- outputs


def test_a_text_message_streams_as_one_block_and_ends_its_turn():
    stream = run(MessageEvents(context()), ["Hel", "", "lo"], "stop")
    assert kinds(stream) == [
        "message_start", "content_block_start:text", "text_delta", "text_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = stream[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 3 and start["usage"]["output_tokens"] == 0
    assert stream[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert stream[-2]["usage"] == {"output_tokens": 3}


def test_the_whole_message_is_the_streamed_one():
    whole = MessageEvents(context()).complete(delta("Hello", "length", 2))
    Message.model_validate(whole)
    assert whole["content"] == [{"type": "text", "text": "Hello"}]
    assert whole["stop_reason"] == "max_tokens" and whole["id"] == "msg_1"
    assert whole["usage"] == {
        "input_tokens": 3,
        "output_tokens": 2,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    events = MessageEvents(context())
    run(events, ["Hel", "lo"], "length")
    assert events.message()["content"] == whole["content"]


def test_cached_prompt_tokens_are_counted_apart():
    output = delta("x", "stop")
    output.num_cached_tokens = 2
    usage = MessageEvents(context()).complete(output)["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (1, 2)


def test_a_stop_sequence_is_named_and_an_abort_has_no_stop_reason():
    body = MessageEvents(context()).complete(delta("Hi", "stop", stop="##"))
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "##")
    assert MessageEvents(context()).complete(delta("Hi", "abort"))["stop_reason"] is None


SPLIT_REASONING = ["<thi", "nk>Hm, 2", " + 3.</th", "ink>", "\n\nIt is", " 5."]


@pytest.mark.parametrize("pieces", [["<think>\nHm, 2 + 3.\n</think>\n\nIt is 5."], SPLIT_REASONING])
def test_reasoning_is_a_thinking_block_before_the_text(pieces):
    ctx = context()
    ctx.reasoning = ReasoningSplit(opened=False, include=True)
    events = MessageEvents(ctx)
    stream = run(events, pieces, "stop")
    thinking = [e for e in stream if e["type"] == "content_block_delta" and e["index"] == 0]
    assert "".join(e["delta"]["thinking"] for e in thinking) == "Hm, 2 + 3."
    seen = kinds(stream)
    assert seen.index("content_block_start:thinking") < seen.index("content_block_start:text")
    assert seen[seen.index("content_block_start:text") - 1] == "content_block_stop"
    message = Message.model_validate(events.message())
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Hm, 2 + 3."  # type: ignore[union-attr]
    assert message.content[1].text == "It is 5." and message.stop_reason == "end_turn"  # type: ignore[union-attr]
    # Cut short while thinking: the thinking alone.
    body = MessageEvents(ctx).complete(delta("<think>Hm, 2 +", "length"))
    assert body["content"] == [{"type": "thinking", "thinking": "Hm, 2 +", "signature": ""}]
    # include_reasoning false (not a Messages field, but the split allows it): the text alone.
    ctx.reasoning = ReasoningSplit(opened=False, include=False)
    body = MessageEvents(ctx).complete(delta("".join(pieces), "stop"))
    assert body["content"] == [{"type": "text", "text": "It is 5."}]


def test_a_named_call_streams_its_input_and_keeps_what_parsed_when_cut_short():
    stream = run(MessageEvents(context(), tool_mode=ToolMode(named="f")), ['{"a"', ": 1}"], "stop")
    assert kinds(stream) == [
        "message_start", "content_block_start:tool_use", "input_json_delta", "input_json_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = stream[1]["content_block"]
    assert start["name"] == "f" and start["input"] == {} and start["id"].startswith("toolu_")
    assert "".join(e["delta"]["partial_json"] for e in stream[2:4]) == '{"a": 1}'
    assert stream[-2]["delta"]["stop_reason"] == "tool_use"
    cut = MessageEvents(context(), tool_mode=ToolMode(named="f"))
    body = cut.complete(delta('{"a": 1, "b": [2, 3', "length"))
    assert body["content"][0]["input"] == {"a": 1, "b": [2, 3]}  # type: ignore[typeddict-item]
    assert body["stop_reason"] == "max_tokens"


def test_required_calls_come_whole_or_as_text_when_cut_short():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    events = MessageEvents(context(), tool_mode=ToolMode(named=None))
    stream = run(events, [text[:20], text[20:]], "stop")
    body = events.message()
    assert [(b["type"], b["name"], b["input"]) for b in body["content"]] == [  # type: ignore[typeddict-item]
        ("tool_use", "f", {"a": 1}),
        ("tool_use", "g", {}),
    ]
    assert body["stop_reason"] == "tool_use"
    assert [e["index"] for e in stream if e["type"] == "content_block_stop"] == [0, 1]
    cut = MessageEvents(context(), tool_mode=ToolMode(named=None)).complete(
        delta(text[:9], "length")
    )
    assert cut["content"] == [{"type": "text", "text": text[:9]}]


def test_auto_calls_are_read_from_the_text_and_come_after_it():
    """The text (all of it), then the calls: the same blocks streamed or not."""
    events = MessageEvents(context(), tool_parser=HermesToolParser())
    pieces = ["  Sure.", ' <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool', "_call>"]
    stream = run(events, [*pieces, " Done."], "stop")
    body = events.message()
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"]
    assert body["content"][0]["text"] == "Sure. Done."  # type: ignore[typeddict-item]
    assert body["content"][1]["input"] == {"a": 1}  # type: ignore[typeddict-item]
    assert body["stop_reason"] == "tool_use"
    starts = [e["index"] for e in stream if e["type"] == "content_block_start"]
    assert starts == [0, 1]
    whole = MessageEvents(context(), tool_parser=HermesToolParser())
    whole.complete(delta("".join([*pieces, " Done."]), "stop"))
    assert [b["type"] for b in whole.message()["content"]] == ["text", "tool_use"]


def test_an_error_after_the_start_is_anthropic_s_envelope():
    assert MessageEvents(context()).error(500, "boom") == {
        "type": "error",
        "error": {"type": "api_error", "message": "boom"},
    }
    assert anthropic_error_body(503, "busy")["error"]["type"] == "overloaded_error"
    body = anthropic_error_body(400, "must be positive", "max_tokens")
    assert body["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: must be positive",
    }
    # A message that names its field already keeps its words.
    assert anthropic_error_body(400, "max_tokens is 0", "max_tokens")["error"]["message"] == (
        "max_tokens is 0"
    )


def test_tool_input_is_an_object_or_empty():
    assert tool_input('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    assert tool_input('{"a": "unfinish') == {}  # a string cut short is no value yet
    assert tool_input("[1]") == {} and tool_input("") == {} and tool_input("nope") == {}


def test_a_stop_sequence_that_cuts_a_forced_call_is_the_stop_reason():
    """The client must not run a call that a stop sequence cut short."""
    events = MessageEvents(context(), tool_mode=ToolMode(named="get_weather"))
    run(events, ['{"city": "Oslo"', ","], "stop", stop=",")
    body = events.message()
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", ",")
