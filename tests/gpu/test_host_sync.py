"""ModelRunner.launch queues a step's forward pass and sampling without waiting for the GPU:
torch's sync debug mode turns any synchronizing call (a blocking copy, .item(), .tolist())
inside it into an error. finish() is where the host waits, once."""

from __future__ import annotations

import pytest
import torch

from aioinfer import LLM
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import ScheduledChunk, StepPlan

pytestmark = pytest.mark.gpu

PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=5),
    SamplingParams(temperature=0, logit_bias={3: 2.0}),
]


def plans(n: int) -> list[StepPlan]:
    """A prefill of n requests, then two decode steps (CUDA-graph replays)."""
    steps = []
    for step in range(3):
        chunks = []
        for r in range(n):
            tokens = tuple(range(5 + r, 25 + r)) if step == 0 else (7,)
            start = 0 if step == 0 else 20 + step - 1
            history = tuple(range(5 + r, 25 + r)) + (7,) * step
            params = PARAMS[r % len(PARAMS)]
            table = (2 * r + 1, 2 * r + 2)
            chunk = ScheduledChunk(
                f"r{r}", tokens, start, table, True, params,
                output_index=step, history=history, prompt_len=20,
            )  # fmt: skip
            chunks.append(chunk)
        steps.append(StepPlan(step, tuple(chunks)))
    return steps


def test_launch_never_waits_for_the_device(tmp_path):
    from tests.support.tiny_models import make_variant
    from tests.support.tokenizers import make_tokenizer

    make_variant("qwen2").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    with LLM(str(tmp_path), dtype="bfloat16", max_model_len=64, max_num_seqs=8,
             num_gpu_blocks_override=64) as llm:  # fmt: skip
        runner = llm.engine.gpu.runner

        def run() -> list[dict[str, list[int]]]:
            results = []
            for plan in plans(6):
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    launched = runner.launch(plan)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                results.append(runner.finish(launched).sampled_token_ids)
            return results

        results = llm.engine.gpu.call(run).result()
        assert all(len(r) == 6 for r in results)
        assert llm.engine.gpu.call(lambda: runner.graph_replays).result() == 2


def test_overlapped_steps_on_cuda_give_the_same_outputs(tmp_path):
    """On CUDA the loop launches step N+1 before it collects N, whose outputs reach the host
    behind N's work only (an event): the outputs are those of one step at a time."""
    from tests.support.tiny_models import make_variant
    from tests.support.tokenizers import make_tokenizer

    make_variant("qwen2").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = [[5 + i, 17, 300 + i] * (2 + i) for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, stop=["a"]),
    ] * 2
    results = []
    for overlap in (False, True):
        with LLM(str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4,
                 num_gpu_blocks_override=256, async_scheduling=overlap, seed=0) as llm:  # fmt: skip
            assert llm.engine.gpu.launch_is_async
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
    assert results[0] == results[1]
