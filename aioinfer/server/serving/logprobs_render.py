"""Logprobs in the API's shapes: completions' legacy block, chat's content list (with each
token's bytes) and vLLM's prompt_logprobs.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from aioinfer.core.outputs import RequestOutput
from aioinfer.core.step import TokenLogprobs
from aioinfer.server.serving.shapes import (
    ChatLogprob,
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprobs,
    TopLogprob,
)

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], list[int]]


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None],
    token_ids: Sequence[int],
    token_text: TokenText,
    offset: int,
    token_bytes: TokenBytes | None = None,
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions logprobs block, and the text offset after its last token;
    `offset` is where the first token's text starts. An entry of None (the first prompt
    token) has no logprob. `token_bytes` (see chat_logprobs) keeps the offsets those of the
    text across tokens that are pieces of a character."""
    out: CompletionLogprobs = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += _text_width(token_id, text, token_bytes)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {token_text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append(top)
    return out, offset


def _text_width(token_id: int, text: str, token_bytes: TokenBytes | None) -> int:
    """How far a token moves the text offset. A piece of a character shows as U+FFFD but is
    not one character of the text: it counts the characters it starts (its bytes that are not
    UTF-8 continuation bytes), so the pieces of one character count it once."""
    if token_bytes is None or "\ufffd" not in text:
        return len(text)
    return sum(1 for byte in token_bytes(token_id) if byte & 0xC0 != 0x80)


def chat_logprobs(
    entries: Sequence[TokenLogprobs], token_text: TokenText, token_bytes: TokenBytes | None
) -> ChatLogprobs:
    """`token_bytes`: a token's own bytes (a piece of a character has some, its text has only
    U+FFFD); None: its text's."""
    bytes_of = token_bytes or (lambda t: list(token_text(t).encode("utf-8", errors="replace")))
    content: list[ChatLogprob] = []
    for entry in entries:
        text = token_text(entry.token_id)
        top: list[TopLogprob] = []
        for token_id, logprob in entry.top:
            top.append(
                {"token": token_text(token_id), "logprob": logprob, "bytes": bytes_of(token_id)}
            )
        content.append(
            {
                "token": text,
                "logprob": entry.logprob,
                "bytes": bytes_of(entry.token_id),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def prompt_logprobs_json(
    output: RequestOutput, token_text: TokenText, num_top: int
) -> PromptLogprobs:
    """vLLM's shape: per prompt token, None for the first (nothing predicts it), then
    {token id: {logprob, rank, decoded_token}} for the token and its `num_top` best
    alternatives. -inf is -9999.0, as vLLM writes it (JSON has no infinity)."""
    out: PromptLogprobs = []
    for entry in output.prompt_logprobs or []:
        if entry is None:
            out.append(None)
            continue
        trimmed = top_trimmed(entry, num_top)
        out.append(
            {
                str(token): {
                    "logprob": max(trimmed[token].logprob, -9999.0),
                    "rank": trimmed[token].rank,
                    "decoded_token": token_text(token),
                }
                for token in trimmed
            }
        )
    return out


def top_trimmed(entry: TokenLogprobs, num_top: int) -> TokenLogprobs:
    return entry if len(entry.top) <= num_top else replace(entry, top=entry.top[:num_top])
