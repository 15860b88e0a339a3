"""Speculative decoding by prompt lookup (vLLM's "ngram" method).

A request in its decode phase feeds its last token plus up to k drafted tokens in one step; the
model's logits at each of the k + 1 positions are sampled as usual, each position as if the
drafts before it were accepted (`draft_rows`). `verify` keeps the drafts up to the first one that
differs from what was sampled there, plus the token sampled at that position (or after the last
draft). Every kept token was sampled from the right distribution given the tokens before it,
so outputs keep their distribution; greedy outputs are the same tokens, only sooner.

Drafts come from the request's own context: when its last n tokens appeared before, the tokens
that followed that earlier occurrence are proposed. Edits, quotes, code and extraction repeat
their context; at random they cost a wider step and save nothing.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from aioinfer.config import NgramSpeculation
from aioinfer.core.step import ScheduledChunk

_ITEM = array("i").itemsize  # token ids as 4-byte ints, searched as bytes


class NgramProposer:
    """Finds drafts for a token sequence; keeps each request's tokens as a bytearray so that a
    lookup is one C-level `rfind` rather than a Python loop over the context."""

    def __init__(self, spec: NgramSpeculation) -> None:
        self.spec = spec
        self._tokens: dict[str, bytearray] = {}

    def propose(
        self, request_id: str, token_ids: Sequence[int], max_drafts: int
    ) -> tuple[int, ...]:
        """Up to min(num_speculative_tokens, max_drafts) tokens that followed the most recent
        earlier occurrence of the longest suffix of `token_ids` (between prompt_lookup_min and
        prompt_lookup_max tokens long); () when there is none."""
        num_drafts = min(self.spec.num_speculative_tokens, max_drafts)
        if num_drafts <= 0:
            return ()
        buf = self._sync(request_id, token_ids)
        num_tokens = len(token_ids)
        low, high = self.spec.prompt_lookup_min, min(self.spec.prompt_lookup_max, num_tokens - 1)
        # A longer suffix can only occur where the shortest does: one scan when none does.
        start = _find_earlier(buf, num_tokens, low) if low <= high else None
        if start is None:
            return ()
        for n in range(high, low, -1):
            longer = _find_earlier(buf, num_tokens, n)
            if longer is not None:
                start = longer
                break
        stop = min(start + num_drafts, num_tokens)
        return tuple(memoryview(buf)[start * _ITEM : stop * _ITEM].cast("i").tolist())

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> bytearray:
        buf = self._tokens.setdefault(request_id, bytearray())
        known = len(buf) // _ITEM  # a request's tokens only grow
        if known < len(token_ids):
            buf += array("i", token_ids[known:]).tobytes()
        return buf


def _find_earlier(buf: bytearray, num_tokens: int, n: int) -> int | None:
    """The index of the token after the most recent occurrence of the last n tokens that ends
    before the last token, or None."""
    suffix = bytes(buf[(num_tokens - n) * _ITEM : num_tokens * _ITEM])
    end = (num_tokens - 1) * _ITEM
    while True:
        pos = buf.rfind(suffix, 0, end)
        if pos < 0:
            return None
        if pos % _ITEM == 0:
            return pos // _ITEM + n
        end = pos + len(suffix) - 1  # a match across token boundaries: look further back


def draft_rows(chunk: ScheduledChunk) -> list[ScheduledChunk]:
    """One sampling row per position of a chunk with drafts: row j samples as if drafts[:j] had
    been accepted. Its output index moves on by j, and its draft_token_ids are drafts[:j], which
    the sampler reads after the (shared) history, for penalties."""
    drafts = chunk.draft_token_ids
    if not drafts:
        return [chunk]
    return [
        dataclasses.replace(chunk, output_index=chunk.output_index + j, draft_token_ids=drafts[:j])
        for j in range(len(drafts) + 1)
    ]


def verify(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a step with `drafts` emits, given the token sampled at each of its
    len(drafts) + 1 positions: the drafts that match, then the first sampled token that does
    not (or the one after the last draft)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(
            f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, got {len(sampled)}"
        )
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return list(sampled[: j + 1])
    return list(sampled)


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: steps with drafts, drafted and accepted tokens, and the
    accepted count per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        missing = num_drafted - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
