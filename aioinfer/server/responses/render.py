"""Responses API bodies and stream events, built from engine outputs.

One class, `ResponseEvents`, turns the output's parts (`output_parts`: reasoning with
--reasoning-parser, text, function calls) into output items delta by delta, and says each step
as a stream event; a non-streamed response is the same run fed the whole output at once, so
both always agree.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from typing_extensions import NotRequired, TypedDict

from aioinfer.core.outputs import CompletionOutput, RequestOutput
from aioinfer.server.serving.context import ResponseContext, new_id
from aioinfer.server.serving.output_parts import (
    ArgumentsDelta,
    CallOpened,
    OutputPart,
    OutputParts,
    ReasoningDelta,
    ReasoningDone,
    TextDelta,
    TextPieces,
)
from aioinfer.server.serving.shapes import ChatLogprob
from aioinfer.server.serving.tool_parsers import ToolParser
from aioinfer.server.serving.tools import ToolMode

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
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
    background: NotRequired[bool]


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


@dataclass
class _Message(TextPieces):
    id: str
    index: int  # in the response's output
    logprobs: list[ChatLogprob] = field(default_factory=list)
    status: Status = "in_progress"


@dataclass
class _Reasoning(TextPieces):
    id: str
    index: int
    status: Status = "in_progress"


@dataclass
class _Call(TextPieces):  # the text is the arguments (JSON)
    id: str
    index: int
    name: str
    call_id: str = field(default_factory=lambda: new_id("call"))
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
        self.on_done = on_done
        self.items: list[_Reasoning | _Message | _Call] = []
        self.finish_reason: str | None = None
        self.output_tokens = 0
        self.cached_tokens = 0
        self._sequence = 0
        self._reasoning: _Reasoning | None = None  # the open reasoning
        self._message: _Message | None = None  # the open message
        self._call: _Call | None = None  # the open call
        self._parts = OutputParts(
            ctx, tool_mode=tool_mode, tool_parser=tool_parser, want_logprobs=want_logprobs
        )

    # ------------------------------------------------------------------ the response

    @property
    def status(self) -> Status:
        if self.finish_reason is None:
            return "in_progress"
        if self.finish_reason == "length":
            return "incomplete"
        return "failed" if self.finish_reason == "abort" else "completed"

    def response(self, status: Status | None = None) -> ResponseObject:
        """The response as it stands; `status` overrides the output's (a background response
        "queued" before it runs, "cancelled" after it was stopped)."""
        status = status or self.status
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
        if status not in ("queued", "in_progress"):
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
            "output_tokens_details": {"reasoning_tokens": self._parts.reasoning_tokens},
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
        for part in self._parts.feed(seq):
            events += self._tell(part)
        return events

    def _tell(self, part: OutputPart) -> list[ResponseStreamEvent]:
        """The events of one part of the output: reasoning is an item of its own, first;
        then a message, and function calls."""
        if isinstance(part, ReasoningDelta):
            return self._reasoning_text(part.text)
        if isinstance(part, ReasoningDone):
            return self._close(self._reasoning, "completed")
        if isinstance(part, TextDelta):
            events = self._open_message() if self._message is None else []
            return events + self._text(part.text, part.logprobs)
        if isinstance(part, CallOpened):  # after the message: one item open at a time
            return self._close(self._message, "completed") + self._open_call(part.name)
        if isinstance(part, ArgumentsDelta):
            return self._arguments(part.text)
        return self._close(self._call, "completed")

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
        message.pieces.append(text)
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
        item.pieces.append(text)
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
        call.pieces.append(text)
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=call.id,
                output_index=call.index,
                delta=text,
            )
        ]

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
                    arguments=item.text,
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
        "arguments": item.text,
        "status": item.status,
    }
