"""The engine's first contact with a GPU, in one run: start it with default sizing, print the
numbers it lives by, then run the heaviest steps it admits over its real KV cache.

1. Start: memory profile (requested, consumed, activations, graph pool, non-torch), num_blocks,
   KV GiB, graph capture seconds and GiB, max_num_seqs, token budget, device memory after.
2. A short greedy generate; the CUDA graph replay counter must have moved.
3. The worst-case steps after the KV allocation: the full token budget as prompts over
   max_num_seqs requests, each sampling with top-k, top-p, penalties and logprobs; then a
   decode of max_num_seqs requests with top-p (eager beyond the largest graph). The peak
   reserved memory is printed beside the engine's share.

Usage: python scripts/gpu_engine_check.py [MODEL] [DTYPE]   (default: dummy Qwen2.5-1.5B, bf16)
Exits 1 when a check fails. Runs on the CPU too (a dry run: no profile, no graphs).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch

from aioinfer import LLM, SamplingParams
from aioinfer.core.step import ScheduledChunk, StepPlan
from aioinfer.gpu import kv_cache
from aioinfer.sizing import requested_bytes

GiB = 1 << 30
MODEL = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen2.5-1.5B-Instruct"
DTYPE = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
CUDA = torch.cuda.is_available()


def device_memory() -> str:
    if not CUDA:
        return "no CUDA device"
    free, total = torch.cuda.mem_get_info()
    return (
        f"free {free / GiB:.2f} of {total / GiB:.2f} GiB, torch reserved "
        f"{torch.cuda.memory_reserved() / GiB:.2f} GiB (peak "
        f"{torch.cuda.max_memory_reserved() / GiB:.2f})"
    )


def print_start(llm: LLM, runner: Any, seconds: float) -> None:
    info = llm.engine.info
    print(f"== start: {seconds:.1f} s to a ready engine on {info.device} ({info.dtype})")
    profile = runner.memory_profile
    if profile is None:
        print("memory profile: none (the KV size was given, or the device is not CUDA)")
    else:
        print(
            f"memory profile: requested {profile.requested / GiB:.2f} GiB (total "
            f"{profile.total / GiB:.2f} x {profile.utilization}), consumed "
            f"{profile.consumed / GiB:.2f} (weights {profile.weights / GiB:.2f}, non-torch "
            f"{profile.non_torch / GiB:.2f}), activations {profile.activations / GiB:.2f}, "
            f"graph pool {profile.graph_pool / GiB:.3f}"
        )
    print(
        f"KV cache: {info.num_blocks} blocks of {info.block_size} tokens, "
        f"{info.available_kv_gib:.2f} GiB, {info.kv_capacity_tokens} tokens; max_model_len "
        f"{info.max_model_len}, max_num_seqs {info.max_num_seqs}, token budget "
        f"{info.max_num_batched_tokens}, attention {info.attention_backend}"
    )
    if info.graphs_off_reason is None:
        print(f"CUDA graphs: {info.graph_capture_seconds:.2f} s, {info.graph_memory_gib:.3f} GiB")
    else:
        print(f"CUDA graphs: off ({info.graphs_off_reason})")
    print(f"device memory after start: {device_memory()}")


def worst_case_steps(runner: Any) -> list[tuple[str, StepPlan]]:
    """The budget's prompts over max_num_seqs requests, then a decode of max_num_seqs, over
    the top blocks of the real cache (the highest addresses: index arithmetic past 2^31)."""
    info = runner.info
    budget, seqs, block_size = info.max_num_batched_tokens, info.max_num_seqs, info.block_size
    params = kv_cache.profile_sampling_params(runner.sampler.max_logprobs)
    prefill = kv_cache.profile_step(budget, seqs, block_size, params)
    first = info.num_blocks - kv_cache.blocks_for(prefill)
    if first < 1:
        raise SystemExit(f"the KV cache ({info.num_blocks} blocks) cannot hold one full step")
    prefill = kv_cache.profile_step(budget, seqs, block_size, params, first_block=first + 1)
    top_p = SamplingParams(temperature=0.8, top_p=0.9)
    context = min(info.max_model_len - 1, 256)
    blocks_each = -(-(context + 1) // block_size)
    count = min(seqs, (info.num_blocks - 1) // blocks_each)
    decode_chunks = tuple(
        ScheduledChunk(
            f"decode-{r}",
            (11,),
            context,
            tuple(
                range(info.num_blocks - (r + 1) * blocks_each, info.num_blocks - r * blocks_each)
            ),
            True,
            top_p,
            output_index=1,
        )
        for r in range(count)
    )
    return [
        (f"prefill {budget} tokens over {len(prefill.chunks)} requests", prefill),
        (f"decode of {count} requests, context {context}", StepPlan(1, decode_chunks)),
    ]


def run_worst_case(llm: LLM, runner: Any) -> bool:
    ok = True
    share = None
    if runner.memory_profile is not None:
        share = requested_bytes(runner.memory_profile.total, runner.memory_profile.utilization)
    for name, plan in worst_case_steps(runner):
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            result = llm.engine.gpu.call(lambda plan=plan: runner.execute(plan)).result()
        except torch.OutOfMemoryError as exc:
            print(f"worst case: {name}: OUT OF MEMORY: {exc}")
            ok = False
            continue
        seconds = time.perf_counter() - start
        sampled = len(result.sampled_token_ids)
        print(f"worst case: {name}: {seconds * 1e3:.0f} ms, {sampled} sampled; {device_memory()}")
        if CUDA and share is not None:
            used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
            print(f"  device memory in use {used / GiB:.2f} GiB beside the share {share / GiB:.2f}")
        if sampled != len(plan.chunks):
            print(f"worst case: {name}: {sampled} of {len(plan.chunks)} requests sampled")
            ok = False
    return ok


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    options: dict[str, Any] = {"load_format": "dummy", "dtype": DTYPE, "seed": 0}
    if not CUDA:
        options.update(kv_cache_memory=0.05, max_num_seqs=16, max_num_batched_tokens=512)
    llm = LLM(MODEL, **options)
    ok = True
    try:
        runner = llm.engine.gpu.call(lambda: llm.engine.gpu.runner).result()
        print_start(llm, runner, time.perf_counter() - start)
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = llm.generate([[100 + i] * 64 for i in range(8)], params, use_tqdm=False)
        replays = llm.engine.gpu.call(lambda: runner.graph_replays).result()
        print(f"generate: {sum(len(o.outputs[0].token_ids) for o in outs)} tokens, "
              f"{replays} CUDA graph replays")  # fmt: skip
        if runner.graph_runner is not None and replays == 0:
            print("FAILED: graphs were captured but never replayed")
            ok = False
        ok = run_worst_case(llm, runner) and ok
    finally:
        llm.shutdown()
    print("engine check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
