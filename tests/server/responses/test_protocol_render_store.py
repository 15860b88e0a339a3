"""The Responses API without a model: requests to chat messages, outputs to items and stream
events, the store of responses."""

from __future__ import annotations

from typing import Any

import pytest

from aioinfer.core.outputs import CompletionOutput, RequestOutput
from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.responses.protocol import (
    INPUT_ITEMS,
    ResponsesRequest,
    items_to_messages,
    responses_params,
)
from aioinfer.server.responses.render import ResponseEvents
from aioinfer.server.responses.store import (
    ResponseStore,
    StoredResponse,
    input_item_page,
    listed_item,
)
from aioinfer.server.serving.context import Prompt, ResponseContext
from aioinfer.server.serving.tool_parsers import HermesToolParser
from aioinfer.server.serving.tools import ToolMode


def context() -> ResponseContext:
    return ResponseContext("resp_1", "m", [Prompt([1, 2, 3])], 1, token_text=str)


def delta(text: str, finish: str | None = None, tokens: int = 1) -> RequestOutput:
    seq = CompletionOutput(0, text, [7] * tokens, finish_reason=finish)
    return RequestOutput("resp_1", None, [1, 2, 3], [seq], finished=finish is not None)


def run(events: ResponseEvents, texts: list[str], finish: str) -> list[dict[str, Any]]:
    """The whole stream of `texts` as deltas, the last one finishing with `finish`."""
    out: list[Any] = events.opening()
    for i, text in enumerate(texts):
        out += events.delta(0, delta(text, finish if i == len(texts) - 1 else None))
    out += events.closing()
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_items_become_chat_messages_calls_joining_the_assistant_turn_before_them():
    items = INPUT_ITEMS.validate_python(
        [
            {"role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Looking.", "annotations": []}]},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]
    )  # fmt: skip
    messages = [m.to_template() for m in items_to_messages(items)]
    calls = messages[1].pop("tool_calls")
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", "f", {"x": 1}),
        ("b", "g", {}),
    ]
    assert messages[:3] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking."},
        {"role": "tool", "content": "1", "tool_call_id": "a"},
    ]
    # A call after a tool message is a turn of its own.
    assert messages[3]["role"] == "assistant" and messages[3]["content"] == ""
    assert messages[3]["tool_calls"][0]["id"] == "c"


def test_request_errors_name_the_responses_field():
    with pytest.raises(RequestValidationError) as info:
        ResponsesRequest.parse({"input": [{"type": "function_call", "name": "f"}]})
    assert info.value.param == "input[0].call_id"
    assert ".function_call." not in info.value.message
    request = ResponsesRequest.parse({"input": "Hi", "instructions": "Sys"})
    chat = request.to_chat([])
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Sys"), ("user", "Hi")]
    with pytest.raises(RequestValidationError) as info, responses_params():
        raise RequestValidationError("too long", "messages")
    assert info.value.param == "input"


def test_a_text_stream_opens_a_message_and_ends_incomplete_at_the_limit():
    events = ResponseEvents(context(), {"store": True})
    stream = run(events, ["Hel", "lo"], "length")
    assert kinds(stream) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done", "incomplete",
    ]  # fmt: skip
    final = stream[-1]["response"]
    assert final["status"] == "incomplete" and final["store"] is True
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    (message,) = final["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "Hello"
    assert stream[2]["item"]["content"] == [] and stream[2]["item"]["status"] == "in_progress"
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["output_tokens"] == 2
    assert stream[0]["response"]["usage"] is None and stream[0]["response"]["output"] == []


def test_a_named_call_streams_its_arguments():
    events = ResponseEvents(context(), {}, tool_mode=ToolMode(named="f"))
    stream = run(events, ['{"a"', ": 1}"], "stop")
    assert kinds(stream) == [
        "created", "in_progress", "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    (call,) = stream[-1]["response"]["output"]
    assert call["name"] == "f" and call["arguments"] == '{"a": 1}' and call["status"] == "completed"
    assert stream[5]["arguments"] == '{"a": 1}' and stream[6]["item"] == call
    assert stream[2]["item"]["arguments"] == "" and stream[2]["item"]["id"] == call["id"]


def test_required_calls_come_whole_at_the_end_or_as_text_when_cut_short():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    stream = run(ResponseEvents(context(), {}, tool_mode=ToolMode(named=None)), [text], "stop")
    output = stream[-1]["response"]["output"]
    assert [(c["name"], c["arguments"]) for c in output] == [("f", '{"a": 1}'), ("g", "{}")]
    assert stream[-1]["type"] == "response.completed"
    cut = run(ResponseEvents(context(), {}, tool_mode=ToolMode(named=None)), [text[:9]], "length")
    (message,) = cut[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == text[:9]


def test_auto_calls_are_read_from_the_text():
    events = ResponseEvents(context(), {}, tool_parser=HermesToolParser())
    pieces = ["  Sure.", ' <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool', "_call>"]
    stream = run(events, pieces, "stop")
    message, call = stream[-1]["response"]["output"]
    assert message["content"][0]["text"] == "Sure." and message["status"] == "completed"
    assert (call["name"], call["arguments"], call["status"]) == ("f", '{"a": 1}', "completed")
    # A call alone opens no message.
    alone = run(ResponseEvents(context(), {}, tool_parser=HermesToolParser()), pieces[1:], "stop")
    assert [item["type"] for item in alone[-1]["response"]["output"]] == ["function_call"]


@pytest.mark.parametrize(
    "pieces",
    [['<tool_call>{"name": "f", "arguments": {}}</tool_call>', " Then text."],
     ["Text, ", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', " more text."]],
)  # fmt: skip
def test_auto_items_come_in_one_order_streamed_or_not(pieces):
    """The message (all its text) first, then the calls; each item done before the next."""
    streamed = run(ResponseEvents(context(), {}, tool_parser=HermesToolParser()), pieces, "stop")
    whole = ResponseEvents(context(), {}, tool_parser=HermesToolParser())
    body = whole.complete(delta("".join(pieces), "stop"))
    kinds_of = [[i["type"] for i in r["output"]] for r in (streamed[-1]["response"], body)]
    assert kinds_of == [["message", "function_call"]] * 2
    opened: list[int] = []
    for event in streamed:
        if event["type"] == "response.output_item.added":
            assert not opened, "an item opened while another was open"
            opened.append(event["output_index"])
        elif event["type"] == "response.output_item.done":
            assert opened.pop() == event["output_index"]


def test_an_aborted_output_fails_and_errors_continue_the_numbering():
    events = ResponseEvents(context(), {})
    stream = run(events, ["x"], "abort")
    assert stream[-1]["type"] == "response.failed"
    assert [i["status"] for i in stream[-1]["response"]["output"]] == ["incomplete"]
    assert stream[-1]["response"]["error"]["code"] == "server_error"
    error = events.error(500, "boom")
    assert error == {
        "type": "error",
        "sequence_number": len(stream),
        "code": "server_error",
        "message": "boom",
        "param": None,
    }


def test_the_whole_response_is_the_streamed_one_and_is_handed_over_once():
    done: list[Any] = []
    whole = ResponseEvents(context(), {}, on_done=done.append).complete(delta("Hi", "stop", 2))
    streamed = run(ResponseEvents(context(), {}), ["H", "i"], "stop")[-1]["response"]
    assert done == [whole]

    def without_ids(response: dict[str, Any]) -> dict[str, Any]:
        return {**response, "output": [{**i, "id": ""} for i in response["output"]]}

    assert without_ids(whole) == without_ids(streamed)  # type: ignore[arg-type]


def stored(name: str, owner: bytes | None = None, text: str = "") -> StoredResponse:
    body = {"id": name, "status": "completed", "output": [], "text": text}
    return StoredResponse.of(body, owner=owner)  # type: ignore[arg-type]


def test_the_store_keeps_the_newest_responses():
    store = ResponseStore(capacity=2)
    for name in ("a", "b", "c"):
        store.put(stored(name))
    assert len(store) == 2 and store.get("a") is None and store.get("c") is not None
    assert store.delete("b") and not store.delete("b") and store.get("b") is None


def test_the_store_keeps_within_its_bytes_and_to_each_key_its_own():
    first, second = stored("a", b"k1", "x" * 5000), stored("b", b"k1", "y" * 5000)
    assert first.size > 5000
    store = ResponseStore(max_bytes=first.size + second.size - 1)
    assert store.put(first) and store.put(second)
    assert store.get("a", b"k1") is None and store.total_bytes == second.size  # the oldest went
    huge = stored("c", None, "z" * store.max_bytes)
    assert not store.put(huge) and store.get("c") is None
    assert store.get("b", b"k2") is None and not store.delete("b", b"k2")
    assert store.get("b", b"k1") is not None and store.delete("b", b"k1")
    assert store.total_bytes == 0


SPLIT_REASONING = ["<thi", "nk>Hm, 2", " + 3.</th", "ink>", "\n\nIt is", " 5."]


@pytest.mark.parametrize("pieces", [["<think>\nHm, 2 + 3.\n</think>\n\nIt is 5."], SPLIT_REASONING])
def test_reasoning_is_an_item_of_its_own_before_the_message(pieces):
    """With --reasoning-parser: a reasoning item (its text streamed as reasoning_text
    events), then the answer's message; what the official client parses."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from aioinfer.server.serving.reasoning import ReasoningSplit

    ctx = context()
    ctx.reasoning = ReasoningSplit(opened=False, include=True)
    settings = ResponsesRequest.parse({"input": "Hi"}).echo()
    events = run(ResponseEvents(ctx, settings), pieces, "stop")
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    reasoning = "".join(e["delta"] for e in events if e["type"].endswith("reasoning_text.delta"))
    assert reasoning == "Hm, 2 + 3."
    kinds_seen = kinds(events)
    assert kinds_seen.index("reasoning_text.done") < kinds_seen.index("content_part.added")
    response = Response.model_validate(events[-1]["response"])
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Hm, 2 + 3."  # type: ignore[union-attr,index]
    assert response.output_text == "It is 5."
    # include_reasoning false: the answer alone.
    ctx.reasoning = ReasoningSplit(opened=False, include=False)
    body = ResponseEvents(ctx, settings).complete(delta("".join(pieces), "stop"))
    assert [item["type"] for item in body["output"]] == ["message"]
    # Cut short while thinking: the reasoning alone, incomplete.
    ctx.reasoning = ReasoningSplit(opened=False, include=True)
    body = ResponseEvents(ctx, settings).complete(delta("<think>Hm, 2 +", "length"))
    assert [(item["type"], item["status"]) for item in body["output"]] == [
        ("reasoning", "incomplete")
    ]
    assert body["status"] == "incomplete"


def test_reasoning_items_sent_back_go_with_the_next_assistant_turn():
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Weather, so a call."}]}  # fmt: skip
    items = INPUT_ITEMS.validate_python(
        [
            {"role": "user", "content": "Weather?"},
            thought,
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
            thought,
            {"role": "assistant", "content": "Sunny."},
        ]
    )
    messages = [m.to_template() for m in items_to_messages(items)]
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None),
        ("assistant", "Weather, so a call."),
        ("tool", None),
        ("assistant", "Weather, so a call."),
    ]


def test_each_kind_of_input_item_is_listed_with_an_id_and_its_parts():
    items = INPUT_ITEMS.validate_python(
        [
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "f",
                "arguments": "{}",
                "id": "fc_1",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
        ]
    )
    user, reasoning, call, output = (listed_item(item) for item in items)
    assert user["id"].startswith("msg_") and user["status"] == "completed"
    assert user["content"] == [{"type": "input_text", "text": "Hi"}]
    assert reasoning["id"].startswith("rs_") and "status" not in reasoning
    assert call == {
        "id": "fc_1",
        "type": "function_call",
        "call_id": "c1",
        "name": "f",
        "arguments": "{}",
        "status": "completed",
    }
    assert output["id"].startswith("fco_") and output["output"] == "3"
    assert listed_item(items[0])["id"] != user["id"]  # a new id each time it is first listed


def test_input_item_pages_follow_both_cursors_in_either_order():
    items = [{"id": f"i{n}"} for n in range(5)]

    def ids(**kwargs: Any) -> tuple[list[str], bool]:
        page = input_item_page(items, **kwargs)
        data = [item["id"] for item in page["data"]]
        assert (page["first_id"], page["last_id"]) == (
            (data[0], data[-1]) if data else (None, None)
        )
        return data, page["has_more"]

    assert ids() == (["i4", "i3", "i2", "i1", "i0"], False)
    assert ids(limit=2, ascending=True) == (["i0", "i1"], True)
    assert ids(limit=2, ascending=True, after="i1") == (["i2", "i3"], True)
    assert ids(limit=2, after="i3", before="i0") == (["i2", "i1"], False)
    assert ids(after="i0") == ([], False)
    with pytest.raises(KeyError, match="before"):
        input_item_page(items, before="i9")


def test_a_key_that_is_not_utf8_still_owns_its_responses():
    """A key from the environment in another encoding arrives with surrogates: hashed from its
    bytes, as the key check does, not a UnicodeEncodeError (a 500)."""
    from aioinfer.server.http.auth import key_digest
    from aioinfer.server.responses.store import owner_of

    key = b"sk-\xe9t\xe9".decode("utf-8", "surrogateescape")
    assert owner_of(key) == key_digest(key) != owner_of("sk-ete")
