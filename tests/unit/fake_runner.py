"""A model stand-in that checks the KV-cache bookkeeping of every plan it runs.

It keeps a slot array like the real KV cache: each step writes the fed tokens at their slots,
then reads each request's whole context back through its block table. The "sampled" token is a
function of that context, so a wrong block table, slot or prefix hit changes the output.
"""

from __future__ import annotations

from aioinfer.core.step import StepPlan, StepResult

VOCAB = 50


def next_token(context: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(context)) % (VOCAB - 3)) + 3


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = StepResult(plan.step_id)
        for chunk in plan.chunks:
            for slot, token in zip(
                chunk.slot_mapping(self.block_size), chunk.token_ids, strict=True
            ):
                self.slots[slot] = token
        for chunk in plan.chunks:
            end = chunk.start_pos + chunk.num_tokens
            context = [self._read(chunk.block_table, p) for p in range(end)]
            assert None not in context, f"{chunk.request_id} reads an unwritten slot"
            if chunk.sample:
                token = next_token(context)  # type: ignore[arg-type]
                if token in chunk.banned_token_ids:
                    token = 3 if 3 not in chunk.banned_token_ids else 4
                result.sampled_token_ids[chunk.request_id] = token
        return result

    def _read(self, block_table: tuple[int, ...], pos: int) -> int | None:
        block = block_table[pos // self.block_size]
        return self.slots[block * self.block_size + pos % self.block_size]


def reference_output(prompt: list[int], max_tokens: int, stop_ids=()) -> list[int]:
    """The tokens an unbatched, unpreempted run produces."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop_ids:
            break
    return out
