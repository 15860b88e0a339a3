"""vLLM's `LLM.beam_search` over the offline LLM: every step is one batch of one-token
requests, one per live beam, each asking for its 2 x beam_width most likely next tokens (the
prefix cache spares recomputing what the beams share). The search itself is core/beam_search.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aioinfer.core.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from aioinfer.core.lora import LoRARequest
from aioinfer.core.outputs import RequestOutput
from aioinfer.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine

# One step's batch: prompts of token ids, one params for all, each prompt's adapter; returns the
# outputs in prompt order (the offline LLM's `generate`, without a progress bar).
Generate = Callable[
    [list[list[int]], SamplingParams, list[LoRARequest | None]], list[RequestOutput]
]


def beam_search(
    engine: AsyncEngine,
    generate: Generate,
    prompts: list[list[int]],
    params: BeamSearchParams,
    loras: list[LoRARequest | None],
) -> list[BeamSearchOutput]:
    step = SamplingParams(
        max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature
    )
    instances = [
        BeamSearchInstance([BeamSearchSequence(list(ids), lora_request=lora)])
        for ids, lora in zip(prompts, loras, strict=True)
    ]
    for _ in range(params.max_tokens):
        live = [beam for instance in instances for beam in instance.beams]
        if not live:
            break
        outputs = generate(
            [beam.tokens for beam in live], step, [beam.lora_request for beam in live]
        )
        # Each live beam's next-token candidates, in the order the beams were sent.
        candidates = iter([output.outputs[0].logprobs[0] for output in outputs])  # type: ignore[index]
        for instance in instances:
            positions = [next(candidates) for _ in instance.beams]
            instance.extend(positions, params, engine.eos_token_ids, engine.max_model_len)
    results = []
    for instance in instances:
        best = instance.best(params, engine.eos_token_ids)
        for beam in best:
            beam.text = engine.tokenizer.decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
