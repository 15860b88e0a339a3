"""Cost of sampling settings on decode steps: offline, N random prompts, one setting at a time.

    .venv/bin/python scripts/bench_sampling.py [--num-prompts 16] [--output-len 48]

Prints, per setting, the medians over the decode steps of `Sampler.sample` and of the whole
step (`runner.execute`), in ms. The bundled model by default (`--model` to change).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from aioinfer import LLM, SamplingParams

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
    "presence_penalty 0.5": {"temperature": 1.0, "presence_penalty": 0.5},
    "repetition_penalty 1.1": {"temperature": 1.0, "repetition_penalty": 1.1},
    "logprobs 5": {"temperature": 1.0, "logprobs": 5},
    "seed": {"temperature": 1.0, "seed": 1},
}


def timed(times: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=48)
    args = parser.parse_args()

    llm = LLM(args.model) if args.model else LLM()
    runner = llm.engine.gpu.runner
    sample_times: list[float] = []
    step_times: list[float] = []
    runner.sampler.sample = timed(sample_times, runner.sampler.sample)
    runner.execute = timed(step_times, runner.execute)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 10_000) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    print(f"{'sampling parameters':28s} {'sample ms':>10s} {'step ms':>10s}")
    for name, settings in SETTINGS.items():
        sample_times.clear()
        step_times.clear()
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **settings)
        llm.generate(prompts, params, use_tqdm=False)
        decode = slice(2, None)  # the first steps prefill
        print(
            f"{name:28s} {statistics.median(sample_times[decode]) * 1e3:10.2f} "
            f"{statistics.median(step_times[decode]) * 1e3:10.2f}"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
