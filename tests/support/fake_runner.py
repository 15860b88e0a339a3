"""A model stand-in that checks the KV-cache bookkeeping of every plan it runs.

It keeps a slot array like the real KV cache: each step writes the fed tokens at their slots,
then reads each request's whole context back through its block table. The "sampled" token is a
function of that context, so a wrong block table, slot or prefix hit changes the output.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from aioinfer.core.spec_decode import verify
from aioinfer.core.step import StepPlan, StepResult

VOCAB = 50
FAKE_HIDDEN = 4  # the size of the fake model's hidden states (pooling)


def next_token(context: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(context)) % (VOCAB - 3)) + 3


def repeating_next_token(context: list[int]) -> int:
    """A model that mostly repeats its context (drafts from prompt lookup then verify), with a
    twist every so often that depends on the whole context (and rejects a draft)."""
    if len(context) % 7 == 0:
        return next_token(context)
    return context[-5] if len(context) >= 5 else next_token(context)


class FakeRunner:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        next_token: Callable[[list[int]], int] = next_token,
        num_labels: int = 0,
    ) -> None:
        """`num_labels`: a classifier, whose fake `score` head keeps that many of the last
        token's hidden values as its logits."""
        self.next_token = next_token
        self.num_labels = num_labels
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.plans: list[StepPlan] = []
        self.last_sampled: dict[str, int] = {}  # by the last plan run, per request

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = StepResult(plan.step_id)
        for chunk in plan.chunks:
            tokens = list(chunk.token_ids)
            if chunk.previous_token:  # sampled by the plan run before, as the real runner does
                tokens[-1] = self.last_sampled[chunk.request_id]
            for slot, token in zip(chunk.slot_mapping(self.block_size), tokens, strict=True):
                self.slots[slot] = token
        for chunk in plan.chunks:
            end = chunk.start_pos + chunk.num_tokens
            context = [self._read(chunk.block_table, p) for p in range(end)]
            assert None not in context, f"{chunk.request_id} reads an unwritten slot"
            if chunk.sample:
                # A token after each position from the last real one on (drafts follow it).
                first = end - len(chunk.draft_token_ids)
                sampled = [
                    self._sample(context[:stop], chunk.banned_token_ids)  # type: ignore[arg-type]
                    for stop in range(first, end + 1)
                ]
                result.sampled_token_ids[chunk.request_id] = verify(chunk.draft_token_ids, sampled)
            if chunk.pooling is not None:
                rows = [fake_hidden(context, p) for p in range(chunk.start_pos, end)]  # type: ignore[arg-type]
                part = _pool_part(chunk.pooling, rows, chunk.start_pos)
                if part is not None and self.num_labels:
                    part = part[: self.num_labels]
                if part is not None:
                    result.pooled[chunk.request_id] = part
        self.last_sampled = {rid: ids[-1] for rid, ids in result.sampled_token_ids.items()}
        return result

    def _sample(self, context: list[int], banned: tuple[int, ...]) -> int:
        token = self.next_token(context)
        if token in banned:
            token = 3 if 3 not in banned else 4
        return token

    def _read(self, block_table: tuple[int, ...], pos: int) -> int | None:
        block = block_table[pos // self.block_size]
        return self.slots[block * self.block_size + pos % self.block_size]


def reference_output(
    prompt: list[int], max_tokens: int, stop_ids=(), next_token=next_token
) -> list[int]:
    """The tokens an unbatched, unpreempted run produces."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out


def fake_hidden(context: list[int], pos: int) -> list[float]:
    """The fake model's final hidden state at `pos`: it reads the context up to there from the
    cache, as attention does, so a wrong slot or prefix hit changes it."""
    return [float(context[pos]), float(pos), float(next_token(context[: pos + 1])), 1.0]


def _pool_part(pooling: str, rows: list[list[float]], start_pos: int) -> np.ndarray | None:
    if pooling == "MEAN":
        return np.asarray(rows, dtype=np.float32).sum(0)
    if pooling == "LAST":
        return np.asarray(rows[-1], dtype=np.float32)
    return np.asarray(rows[0], dtype=np.float32) if start_pos == 0 else None


def reference_pooled(prompt: list[int], pooling: str) -> np.ndarray:
    """The pooled vector of a whole prompt, before any normalization, in float64."""
    rows = np.asarray([fake_hidden(prompt, p) for p in range(len(prompt))], dtype=np.float64)
    return {"MEAN": rows.mean(0), "LAST": rows[-1], "CLS": rows[0]}[pooling]
