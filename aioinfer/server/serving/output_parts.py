"""One chat output, delta by delta, as the parts an API tells it in: reasoning (with
--reasoning-parser), answer text, and tool calls (a named tool_choice streams one call's
arguments; "required" calls come whole once their array is complete; with tool_choice "auto" a
tool parser reads them from the text).

The Responses API (`responses.render`) and the Messages API (`anthropic.render`) both build their
items and events from these parts, so they split an output the same way.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aioinfer.core.outputs import CompletionOutput
from aioinfer.server.serving.context import ResponseContext
from aioinfer.server.serving.logprobs_render import chat_logprobs
from aioinfer.server.serving.shapes import ChatLogprob
from aioinfer.server.serving.tool_parsers import ToolCallStream, ToolParser
from aioinfer.server.serving.tools import ToolCall, ToolMode


@dataclass
class TextPieces:
    """Text that an item or block gathers delta by delta. Kept in pieces: `+=` on an attribute
    copies the whole text for every delta (seconds over a long output)."""

    pieces: list[str] = field(default_factory=list, kw_only=True)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDone:
    """The reasoning ended: the answer follows."""


@dataclass(frozen=True)
class TextDelta:
    """Answer text; the first one opens the answer, even when its text is empty."""

    text: str
    logprobs: list[ChatLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class CallOpened:
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of the open call's arguments (JSON text)."""

    text: str


@dataclass(frozen=True)
class CallDone:
    """The open call is complete. A named call's never comes: the output's end closes it."""


OutputPart = ReasoningDelta | ReasoningDone | TextDelta | CallOpened | ArgumentsDelta | CallDone


class OutputParts:
    """Splits one output (n = 1). `tool_mode`: a forced call (named) or "required" calls;
    `tool_parser`: calls read from the text (tool_choice "auto"); `want_logprobs`: text deltas
    carry their tokens' logprobs."""

    def __init__(
        self,
        ctx: ResponseContext,
        *,
        tool_mode: ToolMode | None = None,
        tool_parser: ToolParser | None = None,
        want_logprobs: bool = False,
    ) -> None:
        self.ctx = ctx
        self.tool_mode = tool_mode
        self.want_logprobs = want_logprobs
        self._thinking = ctx.reasoning.stream() if ctx.reasoning is not None else None
        self._reasoning_count = (
            ctx.reasoning.counter(ctx.token_text) if ctx.reasoning is not None else None
        )
        self._answering = False  # the reasoning ended (ReasoningDone was said)
        self._text_opened = False
        self._call_opened = False  # a named tool_choice's call
        self._required_pieces: list[str] = []  # tool_choice "required": the calls' JSON array
        self._parsing: ToolCallStream | None = tool_parser.stream() if tool_parser else None
        self._parsed_calls: list[ToolCall] = []  # tool_choice "auto": told once the output ends

    def feed(self, seq: CompletionOutput) -> list[OutputPart]:
        """The parts of one delta of the output."""
        parts: list[OutputPart] = []
        if self._thinking is not None:
            split = self.ctx.reasoning
            assert split is not None
            reasoning, answer = self._thinking.feed(seq.text, final=seq.finish_reason is not None)
            if self._reasoning_count is not None:
                self._reasoning_count.feed(seq.token_ids)
            if reasoning and split.include:
                parts.append(ReasoningDelta(reasoning))
            if answer and not self._answering:
                self._answering = True
                parts.append(ReasoningDone())
            if answer:
                return parts + self._answer(answer, seq, logprobs=True)
            if seq.finish_reason is None or self._plain_and_unopened:
                return parts  # no answer yet; or none at all, and so no text
            return parts + self._answer("", seq, logprobs=False)
        return self._answer(seq.text, seq, logprobs=True)

    @property
    def reasoning_tokens(self) -> int:
        """How many of the output's tokens so far were reasoning (0 without a parser)."""
        return 0 if self._reasoning_count is None else self._reasoning_count.count

    @property
    def _plain_and_unopened(self) -> bool:
        """A text answer (no tools) that has not opened."""
        return self.tool_mode is None and self._parsing is None and not self._text_opened

    def _answer(self, text: str, seq: CompletionOutput, *, logprobs: bool) -> list[OutputPart]:
        finished = seq.finish_reason is not None
        mode = self.tool_mode
        if self._parsing is not None:
            return self._parsed(text, finished)
        if mode is None:
            chosen: list[ChatLogprob] = []
            if logprobs and self.want_logprobs and seq.logprobs:
                chosen = chat_logprobs(seq.logprobs, self.ctx.token_text, self.ctx.token_bytes)[
                    "content"
                ]
            self._text_opened = True
            return [TextDelta(text, chosen)]
        if mode.named is not None:  # the text is the call's arguments, streamed as they come
            if not self._call_opened and not text:
                return []  # no call without arguments (a model that only reasoned)
            parts: list[OutputPart] = [] if self._call_opened else [CallOpened(mode.named)]
            self._call_opened = True
            return [*parts, ArgumentsDelta(text)] if text else parts
        self._required_pieces.append(text)  # the calls are known once the array is complete
        return self._required(seq.finish_reason) if finished else []

    def _parsed(self, text: str, finished: bool) -> list[OutputPart]:
        """tool_choice "auto": the text (opened by the first text that is not blank) as it
        comes, then the calls, whole, once the output ended: the text first, streamed or not
        (a whole output's parser gives its text and its calls apart)."""
        assert self._parsing is not None
        content, calls = self._parsing.feed(text, final=finished)
        self._parsed_calls += calls
        parts: list[OutputPart] = []
        if not self._text_opened:
            content = content.lstrip()
        if content:
            self._text_opened = True
            parts.append(TextDelta(content))
        if finished:
            for call in self._parsed_calls:
                parts += whole_call(call.name, call.arguments)
        return parts

    def _required(self, finish_reason: str | None) -> list[OutputPart]:
        assert self.tool_mode is not None
        text = "".join(self._required_pieces)
        calls = self.tool_mode.calls(text, finished=finish_reason == "stop")
        if calls is None:  # cut short: the text as it is
            return [TextDelta(text)]
        parts: list[OutputPart] = []
        for call in calls:
            parts += whole_call(call.name, call.arguments)
        return parts


def whole_call(name: str, arguments: str) -> list[OutputPart]:
    return [CallOpened(name), ArgumentsDelta(arguments), CallDone()]
