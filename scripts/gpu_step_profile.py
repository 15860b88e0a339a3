"""Where a batch-1 decode step's time goes on a GPU: the loop's step time, the GPU thread's
`execute`, and inside it input preparation, the forward (graph replay) and sampling, each timed
with a device sync; then torch.profiler's top ops over a few decode steps.

Usage: python scripts/gpu_step_profile.py [MODEL] (default: dummy Qwen2.5-1.5B-Instruct, bf16)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

import torch

from aioinfer import LLM, SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen2.5-1.5B-Instruct"
DTYPE = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
# Without CUDA (a dry run of this script on the CPU) the syncs do nothing.
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def timed(parts: dict[str, list[float]], name: str, fn):
    def wrapper(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        parts[name].append(time.perf_counter() - start)
        return out

    return wrapper


def replay_time(graphs, count: int = 200) -> float:
    """Seconds per replay of the batch-1 graph over its current inputs, writing no KV."""
    graphs.slot_mapping.fill_(-1)
    graph = graphs.graphs[1]
    sync()
    start = time.perf_counter()
    for _ in range(count):
        graph.replay()
    sync()
    return (time.perf_counter() - start) / count


def main() -> None:
    llm = LLM(MODEL, load_format="dummy", dtype=DTYPE, max_num_seqs=8, max_model_len=256)
    runner = llm.engine.gpu.call(lambda: llm.engine.gpu.runner).result()
    prompt = [[100 + i % 400 for i in range(128)]]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up

    steps: list[float] = []
    llm.engine._step_loop.on_step = lambda plan, result, elapsed: steps.append(elapsed)
    start = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    wall = time.perf_counter() - start
    print(f"unprofiled: {wall / 64 * 1e3:.3f} ms per token; loop step (submit -> result) "
          f"median {statistics.median(steps) * 1e3:.3f} ms over {len(steps)} steps; "
          f"{runner.graph_replays} graph replays")  # fmt: skip

    parts: dict[str, list[float]] = defaultdict(list)
    runner.execute = timed(parts, "execute", runner.execute)
    runner.prepare_inputs = timed(parts, "prepare_inputs", runner.prepare_inputs)
    runner._launch_sampling = timed(parts, "logits + sample", runner._launch_sampling)
    runner.finish = timed(parts, "results to host", runner.finish)
    if runner.graph_runner is not None:
        graphs = runner.graph_runner
        graphs.replay = timed(parts, "graph replay (with input copies)", graphs.replay)
        # On the GPU thread: the static inputs are inference tensors.
        parts["graph replay alone, bs 1"].append(
            llm.engine.gpu.call(lambda: replay_time(graphs)).result()
        )
    llm.generate(prompt, params, use_tqdm=False)
    print("synced parts (median ms):")
    for name, values in parts.items():
        print(f"  {name:36s} {statistics.median(values) * 1e3:8.3f}  (n={len(values)})")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    # Made and entered on the GPU thread, whose ops it records.
    prof = llm.engine.gpu.call(lambda: profile(activities=activities)).result()
    llm.engine.gpu.call(prof.__enter__).result()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    llm.engine.gpu.call(lambda: prof.__exit__(None, None, None)).result()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    if torch.cuda.is_available():
        print(averages.table(sort_by="self_cuda_time_total", row_limit=12))
    llm.shutdown()


if __name__ == "__main__":
    main()
