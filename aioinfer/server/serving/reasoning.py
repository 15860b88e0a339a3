"""The reasoning a thinking model writes before its answer, split from the answer
(--reasoning-parser) into the `reasoning` field of chat messages and deltas, as vLLM's.

Both parsers read a `<think>` ... `</think>` block at the start of the output:
- qwen3: Qwen3 opens the block itself (`<think>` is the first thing it writes) unless thinking
  is off, when its template closes an empty block in the prompt and the output is all answer.
  Qwen3's thinking-only releases open the block in the prompt.
- deepseek_r1: DeepSeek-R1's templates open the block in the prompt (R1-0528 may write
  `<think>` again): the output starts as reasoning whatever the prompt.

Where the block opens in the prompt, the output starts as reasoning. A block that never closes
(max_tokens cut the thinking short) is all reasoning. The whitespace around the reasoning and at
the start of the answer after it is dropped. A whole output is parsed as one stream fed once, so
the split is the same streamed or not.

PURE: no torch, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aioinfer.core.constraints import ConstraintFactory, with_reasoning_gate
from aioinfer.server.serving.tool_parsers import partial_suffix

START = "<think>"
END = "</think>"
PROMPT_TAIL_TOKENS = 8  # enough of the prompt's end to see a `<think>` it opens


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    always_open: bool  # the output starts inside the block whatever the prompt

    def split(
        self, prompt_ids: list[int], tokenizer: Any, *, include: bool, continued: str | None = None
    ) -> ReasoningSplit:
        """How one request's outputs are split, given its prompt's token ids and, where the
        output continues an assistant message (continue_final_message, a prefill), that
        message's text, read as the output's start: one that opens with `<think>` and does not
        close it leaves the block open; one that closes it (or, for a parser whose prompt opens
        the block, any `</think>`) leaves the answer to follow."""
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
        opened = self.always_open or tail.rstrip().endswith(START)
        if continued is not None:
            text = continued.lstrip()
            if text.startswith(START):
                opened = END not in text
            elif opened and END in text:
                opened = False
            elif text:
                opened = self.always_open  # the message began an answer, or R1's reasoning
        start, end = _single_token(tokenizer, START), _single_token(tokenizer, END)
        return ReasoningSplit(
            opened, include, None if start is None or end is None else (start, end)
        )


def continued_text(messages: list[dict[str, Any]]) -> str | None:
    """The text of the last message when it is the assistant's (what continue_final_message
    continues), else None."""
    if not messages or messages[-1].get("role") != "assistant":
        return None
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(p.get("text") or "" for p in parts if isinstance(p, dict))


@dataclass(frozen=True)
class ReasoningSplit:
    """One request's split: whether its output starts inside the block, and whether the
    reasoning is returned (include_reasoning) or dropped."""

    opened: bool
    include: bool
    # The tags' token ids where each is one token (Qwen3's and DeepSeek-R1's vocabularies).
    tags: tuple[int, int] | None = None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.opened)

    def counter(self, token_text: Callable[[int], str]) -> ReasoningTokens:
        return ReasoningTokens(self, token_text)

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole output's reasoning (None when it has none) and answer."""
        reasoning, answer = self.stream().feed(text, final=True)
        return reasoning or None, answer

    def gate(self, constraints: ConstraintFactory) -> ConstraintFactory:
        """`constraints` with the grammar held back while the model reasons, where the tags
        are single tokens (as in Qwen3's and DeepSeek-R1's vocabularies)."""
        if self.tags is None:
            return constraints
        start, end = self.tags
        return with_reasoning_gate(constraints, start, end, opened=self.opened)


class ReasoningTokens:
    """One choice's reasoning tokens (usage's reasoning_tokens), fed its token ids as they come,
    one at a time whatever the deltas, so a whole and a streamed response count the same.
    With single-token tags: the tokens between `<think>` and `</think>` (from the output's
    first token when the block is open; a `<think>` written again there is a tag, not
    reasoning), as vLLM counts them. Otherwise the tokens that leave the text split inside
    the block (the end tag's leading pieces among them)."""

    def __init__(self, split: ReasoningSplit, token_text: Callable[[int], str]) -> None:
        self._split = split
        self._token_text = token_text
        self._mode = "start"
        self._text = split.stream() if split.tags is None else None
        self.count = 0

    def feed(self, token_ids: list[int]) -> None:
        if self._text is not None:
            for token in token_ids:
                self._text.feed(self._token_text(token))
                self.count += self._text.in_reasoning
            return
        assert self._split.tags is not None
        start, end = self._split.tags
        for token in token_ids:
            if self._mode == "answer":
                return
            if self._mode == "start":
                if token == start:
                    self._mode = "reasoning"
                    continue
                if not self._token_text(token).strip():
                    self.count += self._split.opened  # inside an open block, or before one
                    continue
                self._mode = "reasoning" if self._split.opened else "answer"
                if self._mode == "answer":
                    return
            if token == end:
                self._mode = "answer"
            else:
                self.count += 1


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ReasoningStream:
    """One choice's output, fed delta by delta: each feed gives (reasoning, answer) text.

    What is held back between feeds stays small or is kept in pieces (whitespace that may be
    dropped), so a feed costs the length of its delta, even in a model's whitespace loop."""

    def __init__(self, opened: bool) -> None:
        self._unopened = "reasoning" if opened else "answer"  # the mode without a `<think>`
        self._mode = "start"  # until the output shows whether it opens with `<think>`
        self._lead: list[str] = []  # start: whitespace before anything else
        self._head = ""  # start: what came after it, while it could still be `<think>`
        self._partial = ""  # reasoning: an end that could begin `</think>`
        self._held: list[str] = []  # reasoning: trailing whitespace, dropped if the block ends
        self._reasoning_started = False  # its leading whitespace is dropped
        self._strip_answer = False  # after `</think>`: the answer's leading whitespace too

    @property
    def in_reasoning(self) -> bool:
        return self._mode == "reasoning"

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if self._mode == "start":
            delta = self._start(delta, final)
            if self._mode == "start":
                return "", ""
        reasoning = ""
        if self._mode == "reasoning":
            reasoning, delta = self._reasoning(delta, final)
        return reasoning, self._answer(delta) if self._mode == "answer" else ""

    def _start(self, delta: str, final: bool) -> str:
        """Whether the output opens with `<think>`; once known, the text that follows it."""
        if not self._head:
            text = delta.lstrip()
            self._lead.append(delta[: len(delta) - len(text)])
            delta = text
        head = self._head = self._head + delta
        if head.startswith(START):
            self._mode = "reasoning"
            return head[len(START) :]
        if START.startswith(head) and not final:
            return ""  # could still be the tag
        self._mode = self._unopened
        return "".join(self._lead) + head

    def _reasoning(self, delta: str, final: bool) -> tuple[str, str]:
        """The reasoning to send now, and what follows `</think>` once it came."""
        text = self._partial + delta
        index = text.find(END)
        if index >= 0:
            self._partial, self._mode, self._strip_answer = "", "answer", True
            reasoning = self._send(text[:index].rstrip())
            self._held.clear()
            return reasoning, text[index + len(END) :]
        keep = 0 if final else partial_suffix(text, END)
        self._partial, body = text[len(text) - keep :], text[: len(text) - keep]
        kept = body.rstrip()
        reasoning = self._send(kept)
        self._held.append(body[len(kept) :])
        return reasoning, ""

    def _send(self, text: str) -> str:
        """`text`, after the whitespace held back before it (none before the first)."""
        if not text:
            return ""
        if not self._reasoning_started:
            text, self._reasoning_started = text.lstrip(), True
        else:
            text = "".join(self._held) + text
        self._held.clear()
        return text

    def _answer(self, text: str) -> str:
        if self._strip_answer:
            text = text.lstrip()
            self._strip_answer = not text
        return text


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", always_open=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_open=True),
}


def make_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser --reasoning-parser names (ServerConfig checked the name)."""
    return None if name is None else REASONING_PARSERS[name]
