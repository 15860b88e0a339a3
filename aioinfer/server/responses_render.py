"""Responses API bodies and stream events, built from engine outputs.

One class, `ResponseEvents`, turns the output text into output items (reasoning with
--reasoning-parser, a message, function calls) delta by delta, and says each step as a stream
event; a non-streamed response is the same run fed the whole output at once, so both always
agree.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from typing_extensions import NotRequired, TypedDict

from aioinfer.core.outputs import CompletionOutput, RequestOutput
from aioinfer.server.render import ResponseContext, chat_logprobs
from aioinfer.server.responses import ChatLogprob
from aioinfer.server.tool_parsers import ToolCallStream, ToolParser
from aioinfer.server.tools import ToolCall, ToolMode

Status = Literal["in_progress", "completed", "incomplete", "failed"]
# The stream's last event, by the response's final status.
_FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[ChatLogprob]  # with include ["message.output_text.logprobs"]


class OutputMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Status
    content: list[OutputText]


class OutputReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(TypedDict):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[OutputReasoningText]
    status: Status


class OutputFunctionCall(TypedDict):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(TypedDict):
    cached_tokens: int
    cache_write_tokens: int  # computed here, so kept for later prompts (prefix caching)


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(TypedDict):
    code: str
    message: str


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens"]


class ResponseObject(TypedDict):
    """The response; the request's settings (instructions, tools, text, ...) come with it."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Status
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: NotRequired[str | None]
    max_output_tokens: NotRequired[int | None]
    temperature: NotRequired[float | None]
    top_p: NotRequired[float | None]
    tools: NotRequired[list[dict[str, Any]]]
    tool_choice: NotRequired[str | dict[str, Any]]
    parallel_tool_calls: NotRequired[bool]
    text: NotRequired[dict[str, Any]]
    metadata: NotRequired[dict[str, str]]
    previous_response_id: NotRequired[str | None]
    store: NotRequired[bool]


class ResponseStreamEvent(TypedDict):
    """One event of a streamed response; its other fields depend on its type."""

    type: str
    sequence_number: int
    response: NotRequired[ResponseObject]
    output_index: NotRequired[int]
    item: NotRequired[OutputItem]
    item_id: NotRequired[str]
    content_index: NotRequired[int]
    part: NotRequired[OutputText]
    delta: NotRequired[str]
    text: NotRequired[str]
    arguments: NotRequired[str]
    logprobs: NotRequired[list[ChatLogprob]]
    code: NotRequired[str]
    message: NotRequired[str]
    param: NotRequired[str | None]


class ResponseDeleted(TypedDict):
    id: str
    object: Literal["response"]
    deleted: bool


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Message:
    id: str
    index: int  # in the response's output
    text: str = ""
    logprobs: list[ChatLogprob] = field(default_factory=list)
    status: Status = "in_progress"


@dataclass
class _Reasoning:
    id: str
    index: int
    text: str = ""
    status: Status = "in_progress"


@dataclass
class _Call:
    id: str
    index: int
    name: str
    call_id: str = field(default_factory=lambda: new_id("call"))
    arguments: str = ""
    status: Status = "in_progress"


class ResponseEvents:
    """The output of one response (n = 1), built from its deltas, and the stream events that
    tell it. `tool_mode`: a forced call (named) or "required" calls; `tool_parser`: calls read
    from the text (tool_choice "auto"). `settings`: the request's, repeated in the response.
    `on_done` receives the final response once the output is complete."""

    def __init__(
        self,
        ctx: ResponseContext,
        settings: dict[str, Any],
        *,
        tool_mode: ToolMode | None = None,
        tool_parser: ToolParser | None = None,
        want_logprobs: bool = False,
        on_done: Callable[[ResponseObject], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.tool_mode = tool_mode
        self.want_logprobs = want_logprobs
        self.on_done = on_done
        self.items: list[_Reasoning | _Message | _Call] = []
        self.finish_reason: str | None = None
        self.output_tokens = 0
        self.cached_tokens = 0
        self._sequence = 0
        self._reasoning: _Reasoning | None = None  # the open reasoning
        self._thinking = ctx.reasoning.stream() if ctx.reasoning is not None else None
        self._message: _Message | None = None  # the open message
        self._call: _Call | None = None  # the open call of a named tool_choice
        self._required_text = ""  # tool_choice "required": the calls' JSON array so far
        self._parsing: ToolCallStream | None = tool_parser.stream() if tool_parser else None
        self._parsed_calls: list[ToolCall] = []  # tool_choice "auto": sent once the output ends

    # ------------------------------------------------------------------ the response

    @property
    def status(self) -> Status:
        if self.finish_reason is None:
            return "in_progress"
        if self.finish_reason == "length":
            return "incomplete"
        return "failed" if self.finish_reason == "abort" else "completed"

    def response(self) -> ResponseObject:
        status = self.status
        body: ResponseObject = {
            "id": self.ctx.response_id,
            "object": "response",
            "created_at": self.ctx.created,
            "model": self.ctx.model,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "output": [_item_json(item) for item in self.items],
            "usage": None,
            **self.settings,  # type: ignore[typeddict-item]
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "failed":
            body["error"] = {"code": "server_error", "message": "The generation was aborted"}
        if status != "in_progress":
            body["usage"] = self._usage()
        return body

    def _usage(self) -> ResponseUsage:
        return {
            "input_tokens": self.ctx.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": self.ctx.prompt_tokens - self.cached_tokens,
            },
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.ctx.prompt_tokens + self.output_tokens,
        }

    def complete(self, final: RequestOutput) -> ResponseObject:
        """The whole response of a finished output (not streamed)."""
        self.delta(0, final)
        self.closing()
        return self.response()

    # ------------------------------------------------------------------ the stream

    def opening(self) -> list[ResponseStreamEvent]:
        response = self.response()
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def delta(self, prompt_index: int, output: RequestOutput) -> list[ResponseStreamEvent]:
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        events: list[ResponseStreamEvent] = []
        for seq in output.outputs:
            self.output_tokens += len(seq.token_ids)
            events += self._content(seq)
            if seq.finish_reason is not None:
                self.finish_reason = seq.finish_reason
                events += self._close_all()
        return events

    def closing(self) -> list[ResponseStreamEvent]:
        response = self.response()
        if self.on_done is not None:
            self.on_done(response)
        return [self._event(_FINAL_EVENTS[response["status"]], response=response)]

    def error(self, status: int, message: str) -> ResponseStreamEvent:
        """The event of a failure after the stream started (the stream ends with it)."""
        code = "server_error" if status >= 500 else "invalid_request_error"
        return self._event("error", code=code, message=message, param=None)

    def _content(self, seq: CompletionOutput) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        if self._thinking is not None:
            # The reasoning is an item of its own, first; what follows reads the answer.
            split = self.ctx.reasoning
            assert split is not None
            reasoning, answer = self._thinking.feed(seq.text, final=seq.finish_reason is not None)
            if reasoning and split.include:
                events += self._reasoning_text(reasoning)
            if answer:
                events += self._close(self._reasoning, "completed")
            elif seq.finish_reason is None or self._plain_and_unopened:
                return events  # no answer yet; or none at all, and so no message
            seq = replace(seq, text=answer, logprobs=seq.logprobs if answer else None)
        return events + self._answer(seq)

    @property
    def _plain_and_unopened(self) -> bool:
        """A text answer (no tools) whose message has not opened."""
        return self.tool_mode is None and self._parsing is None and self._message is None

    def _answer(self, seq: CompletionOutput) -> list[ResponseStreamEvent]:
        finished = seq.finish_reason is not None
        mode = self.tool_mode
        if self._parsing is not None:
            return self._parsed(seq.text, seq.finish_reason)
        if mode is None:
            logprobs: list[ChatLogprob] = []
            if self.want_logprobs and seq.logprobs:
                logprobs = chat_logprobs(seq.logprobs, self.ctx.token_text)["content"]
            events = self._open_message() if self._message is None else []
            return events + self._text(seq.text, logprobs)
        if mode.named is not None:  # the text is the call's arguments, streamed as they come
            if self._call is None and not seq.text:
                return []  # no call without arguments (a model that only reasoned)
            events = self._open_call(mode.named) if self._call is None else []
            return events + self._arguments(seq.text)
        self._required_text += seq.text  # the calls are known once their array is complete
        return self._required(seq.finish_reason) if finished else []

    def _parsed(self, text: str, finish_reason: str | None) -> list[ResponseStreamEvent]:
        """tool_choice "auto": text as the message (opened by the first text that is not
        blank) as it comes, then the calls, as whole items once the output ended: the items
        come in the same order streamed or not, the message first."""
        assert self._parsing is not None
        finished = finish_reason is not None
        content, calls = self._parsing.feed(text, final=finished)
        self._parsed_calls += calls
        events: list[ResponseStreamEvent] = []
        if self._message is None:
            content = content.lstrip()
            if content:
                events += self._open_message()
        if content:
            events += self._text(content, [])
        if finished:
            events += self._close(self._message, _item_status(finish_reason))
            for call in self._parsed_calls:
                events += self._whole_call(call.name, call.arguments)
        return events

    def _required(self, finish_reason: str | None) -> list[ResponseStreamEvent]:
        assert self.tool_mode is not None
        text = self._required_text
        calls = self.tool_mode.calls(text, finished=finish_reason == "stop")
        if calls is None:  # cut short: the text as it is
            return self._open_message() + self._text(text, [])
        events: list[ResponseStreamEvent] = []
        for call in calls:
            events += self._whole_call(call.name, call.arguments)
        return events

    # ------------------------------------------------------------------ items

    def _open_message(self) -> list[ResponseStreamEvent]:
        message = self._message = _Message(new_id("msg"), len(self.items))
        self.items.append(message)
        item: OutputMessage = {
            "id": message.id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        where = {"item_id": message.id, "output_index": message.index, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=message.index, item=item),
            self._event("response.content_part.added", **where, part=_part("", [])),
        ]

    def _text(self, text: str, logprobs: list[ChatLogprob]) -> list[ResponseStreamEvent]:
        message = self._message
        assert message is not None
        if not text and not logprobs:
            return []
        message.text += text
        message.logprobs += logprobs
        return [
            self._event(
                "response.output_text.delta",
                item_id=message.id,
                output_index=message.index,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        ]

    def _reasoning_text(self, text: str) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        item = self._reasoning
        if item is None:
            item = self._reasoning = _Reasoning(new_id("rs"), len(self.items))
            self.items.append(item)
            added = _item_json(item)
            events.append(
                self._event("response.output_item.added", output_index=item.index, item=added)
            )
        item.text += text
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]

    def _open_call(self, name: str) -> list[ResponseStreamEvent]:
        call = self._call = _Call(new_id("fc"), len(self.items), name)
        self.items.append(call)
        item = _item_json(call)
        return [self._event("response.output_item.added", output_index=call.index, item=item)]

    def _arguments(self, text: str) -> list[ResponseStreamEvent]:
        call = self._call
        assert call is not None
        if not text:
            return []
        call.arguments += text
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=call.id,
                output_index=call.index,
                delta=text,
            )
        ]

    def _whole_call(self, name: str, arguments: str) -> list[ResponseStreamEvent]:
        events = self._open_call(name) + self._arguments(arguments)
        return events + self._close(self._call, "completed")

    def _close_all(self) -> list[ResponseStreamEvent]:
        """At the end of the output: what is still open ends as the response does."""
        status = _item_status(self.finish_reason)
        events: list[ResponseStreamEvent] = []
        for item in (self._reasoning, self._message, self._call):
            events += self._close(item, status)
        return events

    def _close(
        self, item: _Reasoning | _Message | _Call | None, status: Status
    ) -> list[ResponseStreamEvent]:
        """The events that end an item; the open one it was is then closed."""
        if item is None:
            return []
        item.status = status
        done = _item_json(item)
        events: list[ResponseStreamEvent] = []
        if isinstance(item, _Reasoning):
            self._reasoning = None
            where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
            events.append(self._event("response.reasoning_text.done", **where, text=item.text))
        elif isinstance(item, _Message):
            self._message = None
            where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
            part = _part(item.text, item.logprobs)
            events += [
                self._event(
                    "response.output_text.done", **where, text=item.text, logprobs=item.logprobs
                ),
                self._event("response.content_part.done", **where, part=part),
            ]
        else:
            self._call = None
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=item.index,
                    arguments=item.arguments,
                )
            )
        events.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return events

    def _event(self, kind: str, **fields: Any) -> ResponseStreamEvent:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return cast(ResponseStreamEvent, event)


def _item_status(finish_reason: str | None) -> Status:
    """How an output's items end: completed, unless max_tokens or an abort cut them."""
    return "incomplete" if finish_reason in ("length", "abort") else "completed"


def _part(text: str, logprobs: list[ChatLogprob]) -> OutputText:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _item_json(item: _Reasoning | _Message | _Call) -> OutputItem:
    if isinstance(item, _Reasoning):
        return {
            "id": item.id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": item.text}],
            "status": item.status,
        }
    if isinstance(item, _Message):
        return {
            "id": item.id,
            "type": "message",
            "role": "assistant",
            "status": item.status,
            "content": [_part(item.text, item.logprobs)],
        }
    return {
        "id": item.id,
        "type": "function_call",
        "call_id": item.call_id,
        "name": item.name,
        "arguments": item.arguments,
        "status": item.status,
    }
