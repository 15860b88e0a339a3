"""Engine outputs to /v1/completions and /v1/chat/completions bodies and SSE chunks.

PURE (no torch, no asyncio): plain functions and classes over the core outputs, returning the
dicts of `shapes` that orjson serializes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from aioinfer.core.outputs import CompletionOutput, RequestOutput
from aioinfer.core.step import TokenLogprobs
from aioinfer.server.openai.shapes import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
)
from aioinfer.server.serving.context import ResponseContext
from aioinfer.server.serving.logprobs_render import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    top_trimmed,
)
from aioinfer.server.serving.reasoning import ReasoningStream, ReasoningTokens
from aioinfer.server.serving.shapes import CompletionLogprobs, ToolCallJson
from aioinfer.server.serving.tool_parsers import ToolCallStream, ToolParser
from aioinfer.server.serving.tools import ToolMode, new_call_id


def usage(
    ctx: ResponseContext, completion_tokens: int, reasoning_tokens: int | None = None
) -> UsageInfo:
    prompt_tokens = ctx.prompt_tokens
    info: UsageInfo = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if ctx.cached_tokens is not None:
        info["prompt_tokens_details"] = {"cached_tokens": sum(ctx.cached_tokens.values())}
    if reasoning_tokens is not None:
        info["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return info


def completion_response(
    ctx: ResponseContext,
    finals: Sequence[RequestOutput],
    *,
    echo_texts: Sequence[str] | None,
    want_logprobs: bool,
) -> CompletionResponse:
    """The non-streaming /v1/completions body; `echo_texts` holds each prompt's text when the
    request asked for echo."""
    choices: list[CompletionChoice] = []
    completion_tokens = 0
    for p, final in enumerate(finals):
        ctx.saw(p, final)
        for seq in final.outputs:
            completion_tokens += len(seq.token_ids)
            echo = echo_texts[p] if echo_texts is not None else ""
            logprobs = None
            if want_logprobs:
                prompt_entries = final.prompt_logprobs if echo_texts is not None else None
                logprobs, start = _echoed_prompt_logprobs(ctx, p, prompt_entries, echo)
                _extend_logprobs(logprobs, seq, ctx, start)
            choice: CompletionChoice = {
                "index": ctx.choice_index(p, seq.index),
                "text": echo + seq.text,
                "logprobs": logprobs,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            }
            if ctx.return_token_ids:
                choice["prompt_token_ids"] = ctx.prompts[p].token_ids
                choice["token_ids"] = seq.token_ids
            if ctx.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(
                    final, ctx.token_text, ctx.prompt_logprobs
                )
            choices.append(choice)
    return {
        "id": ctx.response_id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage(ctx, completion_tokens),
    }


def _echoed_prompt_logprobs(
    ctx: ResponseContext,
    prompt_index: int,
    entries: Sequence[TokenLogprobs | None] | None,
    echo_text: str,
) -> tuple[CompletionLogprobs, int]:
    """The prompt part of an echoed completion's logprobs (empty without echo, i.e. None),
    and the text offset after it."""
    if entries is None:
        return completion_logprobs([], [], ctx.token_text, 0)
    ids = ctx.prompts[prompt_index].token_ids
    width = ctx.echo_logprobs
    cut = [None if e is None else top_trimmed(e, width) for e in entries]
    block, end = completion_logprobs(cut, ids, ctx.token_text, 0, ctx.token_bytes)
    tokens = block["tokens"]
    if tokens and tokens[0].startswith(" ") and not echo_text.startswith(" "):
        # A SentencePiece decoder drops the space of a text's first word, which the token's
        # own text keeps: the first token and the offsets after it follow the text.
        tokens[0] = tokens[0][1:]
        block["text_offset"] = [0, *(offset - 1 for offset in block["text_offset"][1:])]
        end -= 1
    return block, end


def _extend_logprobs(
    logprobs: CompletionLogprobs, seq: CompletionOutput, ctx: ResponseContext, start: int
) -> int:
    """Append the logprobs of `seq`'s tokens, whose text starts at offset `start`; the offset
    after them."""
    more, end = completion_logprobs(
        seq.logprobs or [], seq.token_ids, ctx.token_text, start, ctx.token_bytes
    )
    for key in logprobs:
        logprobs[key].extend(more[key])  # type: ignore[literal-required]
    return end


def chat_response(
    ctx: ResponseContext,
    final: RequestOutput,
    *,
    want_logprobs: bool,
    tool_mode: ToolMode | None = None,
    tool_parser: ToolParser | None = None,
) -> ChatCompletionResponse:
    """`tool_mode`: tool_choice constrained the output to calls; `tool_parser`: tool_choice
    "auto", calls are read from the text."""
    choices: list[ChatChoice] = []
    completion_tokens = 0
    reasoning_tokens = None if ctx.reasoning is None else 0
    ctx.saw(0, final)
    for seq in final.outputs:
        completion_tokens += len(seq.token_ids)
        logprobs = (
            chat_logprobs(seq.logprobs or [], ctx.token_text, ctx.token_bytes)
            if want_logprobs
            else None
        )
        reasoning = None
        if ctx.reasoning is not None:  # what follows reads only the answer
            reasoning, answer = ctx.reasoning.parse(seq.text)
            counter = ctx.reasoning.counter(ctx.token_text)
            counter.feed(seq.token_ids)
            reasoning_tokens = (reasoning_tokens or 0) + counter.count
            seq = replace(seq, text=answer)
        message: ChatResponseMessage = {"role": "assistant", "content": seq.text}
        finish_reason = seq.finish_reason
        calls = _tool_calls(tool_mode, seq)
        if calls is not None and tool_mode is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            if finish_reason == "stop":
                finish_reason = tool_mode.finish_reason
        elif tool_parser is not None:
            content, parsed = tool_parser.parse(seq.text)
            if parsed:
                message = {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [call.to_json() for call in parsed],
                }
                finish_reason = _auto_finish(seq.finish_reason)
        if reasoning is not None and ctx.reasoning is not None:
            message["content"] = message["content"] or None
            if ctx.reasoning.include:
                message["reasoning"] = reasoning
        choice: ChatChoice = {
            "index": seq.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": seq.stop_reason,
        }
        if ctx.return_token_ids:
            choice["token_ids"] = seq.token_ids
        choices.append(choice)
    response: ChatCompletionResponse = {
        "id": ctx.response_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage(ctx, completion_tokens, reasoning_tokens),
    }
    if ctx.return_token_ids:
        response["prompt_token_ids"] = ctx.prompts[0].token_ids
    if ctx.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(
            final, ctx.token_text, ctx.prompt_logprobs
        )
    return response


def _tool_calls(tool_mode: ToolMode | None, seq: CompletionOutput) -> list[ToolCallJson] | None:
    """The tool calls of a tool_choice request's output; None for plain text (no
    tool_choice, or a "required" array that max_tokens or a stop string cut short)."""
    if tool_mode is None:
        return None
    calls = tool_mode.calls(seq.text, finished=seq.finish_reason == "stop")
    return None if calls is None else [call.to_json() for call in calls]


def _auto_finish(finish_reason: str | None) -> str | None:
    # The model ended its turn after calling tools: OpenAI says "tool_calls".
    return "tool_calls" if finish_reason == "stop" else finish_reason


@dataclass
class StreamOptionsView:
    include_usage: bool = False
    continuous_usage: bool = False


class _ChunkStream:
    """Shared bookkeeping of the streaming renderers: token counts and usage."""

    object_name = ""

    def __init__(self, ctx: ResponseContext, options: StreamOptionsView) -> None:
        self.ctx = ctx
        self.options = options
        self.completion_tokens = 0

    def _usage_now(self) -> UsageInfo:
        return usage(self.ctx, self.completion_tokens, self._reasoning_tokens())

    def _reasoning_tokens(self) -> int | None:
        return None

    def _with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self.options.continuous_usage:
            chunk["usage"] = self._usage_now()
        return chunk

    def closing(self) -> list[dict[str, Any]]:
        """The final usage chunk (empty choices) when include_usage was asked for."""
        if not self.options.include_usage:
            return []
        return [self._envelope([], usage=self._usage_now())]

    def _envelope(self, choices: list[Any], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.ctx.response_id,
            "object": self.object_name,
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": choices,
            **extra,
        }


class CompletionChunks(_ChunkStream):
    """The SSE chunks of a streamed /v1/completions response."""

    object_name = "text_completion"

    def __init__(
        self,
        ctx: ResponseContext,
        options: StreamOptionsView,
        *,
        echo_texts: Sequence[str] | None,
        want_logprobs: bool,
    ) -> None:
        super().__init__(ctx, options)
        self.echo_texts = echo_texts
        self.want_logprobs = want_logprobs
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        self.ctx.saw(prompt_index, output)
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = output.prompt_logprobs
        chunks = []
        for seq in output.outputs:
            index = self.ctx.choice_index(prompt_index, seq.index)
            self.completion_tokens += len(seq.token_ids)
            first = index not in self._started
            text, logprobs = self._content(prompt_index, index, seq)
            ids = self.ctx.return_token_ids and bool(seq.token_ids)
            if text or logprobs is not None or ids:
                chunk = self._chunk(index, text, logprobs, None, None)
                if self.ctx.return_token_ids:
                    choice = chunk["choices"][0]
                    if first:
                        choice["prompt_token_ids"] = self.ctx.prompts[prompt_index].token_ids
                    choice["token_ids"] = seq.token_ids
                chunks.append(chunk)
            if seq.finish_reason is not None:
                chunks.append(self._chunk(index, "", None, seq.finish_reason, seq.stop_reason))
        return chunks

    def _content(
        self, prompt_index: int, index: int, seq: CompletionOutput
    ) -> tuple[str, CompletionLogprobs | None]:
        first = index not in self._started
        self._started.add(index)
        echo = self.echo_texts[prompt_index] if first and self.echo_texts is not None else ""
        if not self.want_logprobs or (not seq.token_ids and not echo):
            return echo + seq.text, None
        prompt_entries = self._prompt_logprobs.get(prompt_index) if echo else None
        logprobs, echo_end = _echoed_prompt_logprobs(self.ctx, prompt_index, prompt_entries, echo)
        start = self._offsets.get(index, echo_end)
        self._offsets[index] = _extend_logprobs(logprobs, seq, self.ctx, start)
        return echo + seq.text, logprobs

    def _chunk(
        self,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> dict[str, Any]:
        choice: CompletionChoice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return self._with_usage(self._envelope([choice]))


class ChatChunks(_ChunkStream):
    """The SSE chunks of a streamed /v1/chat/completions response: a role chunk per choice,
    content chunks, then a chunk with an empty delta and the finish_reason."""

    object_name = "chat.completion.chunk"

    def __init__(
        self,
        ctx: ResponseContext,
        options: StreamOptionsView,
        *,
        want_logprobs: bool,
        tool_mode: ToolMode | None = None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        super().__init__(ctx, options)
        self.want_logprobs = want_logprobs
        self.tool_mode = tool_mode
        self.tool_parser = tool_parser
        self._parsing: dict[int, ToolCallStream] = {}  # tool_choice "auto": per choice
        self._reasoning: dict[int, ReasoningStream] = {}  # --reasoning-parser: per choice
        self._reasoning_counts: dict[int, ReasoningTokens] = {}
        # Named tool_choice: each choice's call id, set by its first delta. "required": each
        # choice's text so far (in pieces: joined once), which becomes calls once complete.
        self._call_ids: dict[int, str] = {}
        self._texts: dict[int, list[str]] = {}

    def opening(self) -> list[dict[str, Any]]:
        chunks = [
            self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
            for i in range(self.ctx.n)
        ]  # fmt: skip
        if self.ctx.return_token_ids:
            chunks[0]["prompt_token_ids"] = self.ctx.prompts[0].token_ids
        return chunks

    def delta(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        self.ctx.saw(prompt_index, output)
        chunks = []
        for seq in output.outputs:
            self.completion_tokens += len(seq.token_ids)
            logprobs = None
            if self.want_logprobs and seq.token_ids:
                logprobs = chat_logprobs(
                    seq.logprobs or [], self.ctx.token_text, self.ctx.token_bytes
                )
            reasoning, seq = self._split_reasoning(seq)
            delta, finish_reason = self._content(seq)
            if reasoning:
                delta["reasoning"] = reasoning
            ids = self.ctx.return_token_ids and bool(seq.token_ids)
            if delta or logprobs is not None or ids:
                choice: ChatChunkChoice = {
                    "index": seq.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
                if self.ctx.return_token_ids:
                    choice["token_ids"] = seq.token_ids
                chunks.append(self._chunk(choice))  # fmt: skip
            if finish_reason is not None:
                chunks.append(
                    self._chunk({"index": seq.index, "delta": {}, "logprobs": None,
                                 "finish_reason": finish_reason,
                                 "stop_reason": seq.stop_reason})
                )  # fmt: skip
        return chunks

    def _split_reasoning(self, seq: CompletionOutput) -> tuple[str, CompletionOutput]:
        """The reasoning in a choice's new text ("" unless it is returned), and the choice
        with only its answer's text."""
        split = self.ctx.reasoning
        if split is None:
            return "", seq
        stream = self._reasoning.setdefault(seq.index, split.stream())
        reasoning, answer = stream.feed(seq.text, final=seq.finish_reason is not None)
        counter = self._reasoning_counts.setdefault(seq.index, split.counter(self.ctx.token_text))
        counter.feed(seq.token_ids)
        return (reasoning if split.include else ""), replace(seq, text=answer)

    def _reasoning_tokens(self) -> int | None:
        if self.ctx.reasoning is None:
            return None
        return sum(c.count for c in self._reasoning_counts.values())

    def _content(self, seq: CompletionOutput) -> tuple[ChatDelta, str | None]:
        """The delta of one choice's new text, and its finish_reason once it finished."""
        mode = self.tool_mode
        if mode is None and self.tool_parser is not None:
            return self._parsed_content(seq)
        if mode is None:
            return ({"content": seq.text} if seq.text else {}), seq.finish_reason
        if mode.named is not None:
            # The text is the arguments: stream it as they come, under one call.
            if not seq.text:
                return {}, seq.finish_reason
            call: dict[str, Any] = {"index": 0, "function": {"arguments": seq.text}}
            if seq.index not in self._call_ids:
                self._call_ids[seq.index] = new_call_id()
                call.update(id=self._call_ids[seq.index], type="function")
                call["function"]["name"] = mode.named
            return {"tool_calls": [call]}, seq.finish_reason
        # "required": the calls are known once their JSON array is complete.
        self._texts.setdefault(seq.index, []).append(seq.text)
        if seq.finish_reason is None:
            return {}, None
        text = "".join(self._texts[seq.index])
        whole = CompletionOutput(seq.index, text, [], finish_reason=seq.finish_reason)
        calls = _tool_calls(mode, whole)
        if calls is None:
            return ({"content": text} if text else {}), seq.finish_reason
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        return {"tool_calls": deltas}, mode.finish_reason

    def _parsed_content(self, seq: CompletionOutput) -> tuple[ChatDelta, str | None]:
        assert self.tool_parser is not None
        stream = self._parsing.setdefault(seq.index, self.tool_parser.stream())
        first = stream.num_calls
        content, calls = stream.feed(seq.text, final=seq.finish_reason is not None)
        delta: ChatDelta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [
                {"index": first + i, **call.to_json()} for i, call in enumerate(calls)
            ]
        finish = _auto_finish(seq.finish_reason) if stream.num_calls else seq.finish_reason
        return delta, finish

    def _chunk(self, choice: ChatChunkChoice) -> dict[str, Any]:
        return self._with_usage(self._envelope([choice]))
