"""Messages API bodies and stream events, built from engine outputs.

One class, `MessageEvents`, turns the output's parts (`output_parts`: reasoning with
--reasoning-parser, text, tool calls) into content blocks (thinking, text, tool_use) delta by
delta, and says each step as a stream event; a non-streamed message is the same run fed the
whole output at once, so both always agree. One block is open at a time: a block of another
kind stops it.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import pydantic_core
from typing_extensions import NotRequired, TypedDict

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.http.errors import AnthropicErrorResponse, anthropic_error_body
from aioinfer.server.serving.context import ResponseContext, new_id
from aioinfer.server.serving.output_parts import (
    ArgumentsDelta,
    CallDone,
    CallOpened,
    OutputPart,
    OutputParts,
    ReasoningDelta,
    ReasoningDone,
    TextDelta,
    TextPieces,
)
from aioinfer.server.serving.tool_parsers import ToolParser
from aioinfer.server.serving.tools import ToolMode

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
BlockKind = Literal["thinking", "text", "tool_use"]


class ThinkingContent(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: str  # Anthropic's proof of its own reasoning: none here


class TextContent(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseContent(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = ThinkingContent | TextContent | ToolUseContent


class MessageUsage(TypedDict):
    input_tokens: int  # the prompt's tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int  # prefix-cache hits
    cache_creation_input_tokens: int  # always 0: cache_control is not honoured


class MessageObject(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None  # None while streaming, or when the server aborted it
    stop_sequence: str | None
    usage: MessageUsage


class MessageDeltaUsage(TypedDict):
    output_tokens: int


class MessageStreamEvent(TypedDict):
    """One event of a streamed message; its other fields depend on its type."""

    type: str
    message: NotRequired[MessageObject]
    index: NotRequired[int]
    content_block: NotRequired[ContentBlock]
    delta: NotRequired[dict[str, Any]]
    usage: NotRequired[MessageDeltaUsage]


class MessageTokensCount(TypedDict):
    input_tokens: int


@dataclass
class _Block(TextPieces):  # the thinking, the text, or a call's input as JSON text
    kind: BlockKind
    index: int  # in the message's content
    id: str = ""
    name: str = ""


class MessageEvents:
    """The content of one message (n = 1), built from its deltas, and the stream events that
    tell it. `tool_mode`: a forced call (tool_choice tool) or "required" calls (any);
    `tool_parser`: calls read from the text (auto)."""

    def __init__(
        self,
        ctx: ResponseContext,
        *,
        tool_mode: ToolMode | None = None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.ctx = ctx
        self.blocks: list[_Block] = []
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop sequence that ended the output
        self.output_tokens = 0
        self.cached_tokens = 0
        self._started = False  # message_start went out
        self._open: _Block | None = None
        self._parts = OutputParts(ctx, tool_mode=tool_mode, tool_parser=tool_parser)

    # ------------------------------------------------------------------ the message

    def message(self) -> MessageObject:
        stop_reason, stop_sequence = self._stop()
        return {
            "id": self.ctx.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model,
            "content": [_block_json(block) for block in self.blocks],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage(),
        }

    def _stop(self) -> tuple[StopReason | None, str | None]:
        if self.finish_reason == "length":
            return "max_tokens", None
        if self.finish_reason != "stop":
            return None, None  # still running, or aborted
        if self.stop_string is not None:  # before tool_use: it may have cut a call short
            return "stop_sequence", self.stop_string
        if any(block.kind == "tool_use" for block in self.blocks):
            return "tool_use", None
        return "end_turn", None

    def _usage(self) -> MessageUsage:
        return {
            "input_tokens": self.ctx.prompt_tokens - self.cached_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": 0,
        }

    def complete(self, final: RequestOutput) -> MessageObject:
        """The whole message of a finished output (not streamed)."""
        self.delta(0, final)
        self.closing()
        return self.message()

    # ------------------------------------------------------------------ the stream

    def opening(self) -> list[MessageStreamEvent]:
        return []  # message_start waits for the first delta, which tells the cached tokens

    def delta(self, prompt_index: int, output: RequestOutput) -> list[MessageStreamEvent]:
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        events = self._start_message()
        for seq in output.outputs:
            self.output_tokens += len(seq.token_ids)
            for part in self._parts.feed(seq):
                events += self._tell(part)
            if seq.finish_reason is not None:
                self.finish_reason = seq.finish_reason
                if isinstance(seq.stop_reason, str):
                    self.stop_string = seq.stop_reason
                events += self._stop_block()
        return events

    def closing(self) -> list[MessageStreamEvent]:
        stop_reason, stop_sequence = self._stop()
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return [
            *self._start_message(),
            *self._stop_block(),
            self._event("message_delta", delta=delta, usage={"output_tokens": self.output_tokens}),
            self._event("message_stop"),
        ]

    def error(self, status: int, message: str) -> AnthropicErrorResponse:
        """The event of a failure after the stream started (the stream ends with it)."""
        return anthropic_error_body(status, message)

    def _start_message(self) -> list[MessageStreamEvent]:
        if self._started:
            return []
        self._started = True
        # Anthropic's streams send a ping right after the start; clients skip it.
        return [self._event("message_start", message=self.message()), self._event("ping")]

    def _tell(self, part: OutputPart) -> list[MessageStreamEvent]:
        """The events of one part of the output."""
        if isinstance(part, ReasoningDelta):
            return self._extend("thinking", part.text, {"type": "thinking_delta"}, "thinking")
        if isinstance(part, TextDelta):
            return self._extend("text", part.text, {"type": "text_delta"}, "text")
        if isinstance(part, CallOpened):
            block = _Block("tool_use", len(self.blocks), id=new_id("toolu"), name=part.name)
            return self._stop_block() + self._start_block(block)
        if isinstance(part, ArgumentsDelta):
            assert self._open is not None and self._open.kind == "tool_use"
            delta = {"type": "input_json_delta"}
            return self._extend("tool_use", part.text, delta, "partial_json")
        if isinstance(part, ReasoningDone) and (
            self._open is None or self._open.kind != "thinking"
        ):
            return []  # the reasoning was dropped (include_reasoning false)
        assert isinstance(part, ReasoningDone | CallDone)
        return self._stop_block()

    def _extend(
        self, kind: BlockKind, text: str, delta: dict[str, Any], key: str
    ) -> list[MessageStreamEvent]:
        """`text` added to the open block of `kind` (opened here, after stopping one of
        another kind); the delta event says it under `key`."""
        events: list[MessageStreamEvent] = []
        block = self._open
        if block is None or block.kind != kind:
            block = _Block(kind, len(self.blocks))
            events = self._stop_block() + self._start_block(block)
        if text:
            block.pieces.append(text)
            events.append(
                self._event("content_block_delta", index=block.index, delta={**delta, key: text})
            )
        return events

    def _start_block(self, block: _Block) -> list[MessageStreamEvent]:
        self.blocks.append(block)
        self._open = block
        return [
            self._event("content_block_start", index=block.index, content_block=_block_json(block))
        ]

    def _stop_block(self) -> list[MessageStreamEvent]:
        block, self._open = self._open, None
        return [] if block is None else [self._event("content_block_stop", index=block.index)]

    @staticmethod
    def _event(kind: str, **fields: Any) -> MessageStreamEvent:
        return cast(MessageStreamEvent, {"type": kind, **fields})


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's input from its JSON text: what parses of it (a call cut short by max_tokens
    keeps the keys it completed, as Anthropic's client reads a streamed one), {} for text that
    is no object."""
    try:
        value = pydantic_core.from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _block_json(block: _Block) -> ContentBlock:
    if block.kind == "thinking":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.id, "name": block.name, "input": tool_input(block.text)}
