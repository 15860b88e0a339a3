"""What constraints cost: the bundled SmolLM2 offline, 32 prompts x 64 greedy output tokens,
plain, with a regex grammar (a counted repeat, xgrammar's slow case) and with
allowed_token_ids; three alternating rounds, the best and the median wall time of each.
Run: .venv/bin/python scripts/bench_constraints.py"""

import statistics
import time

from aioinfer import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = [f"Write a sentence about the number {i}." for i in range(32)]
OUTPUT_TOKENS = 64


def main() -> None:
    llm = LLM(dtype="float32", kv_cache_memory=1.0, max_model_len=1024)
    # min_tokens = max_tokens: every case makes exactly OUTPUT_TOKENS tokens.
    base = {"temperature": 0, "max_tokens": OUTPUT_TOKENS, "min_tokens": OUTPUT_TOKENS}
    cases = {
        "plain": SamplingParams(**base),
        "regex": SamplingParams(
            **base, structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,1000}")
        ),
        "allowed": SamplingParams(**base, allowed_token_ids=list(range(200, 20000))),
    }
    llm.generate(PROMPTS, cases["plain"], use_tqdm=False)  # warm-up; caches the prompts
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(3):
        for name, params in cases.items():
            start = time.perf_counter()
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == OUTPUT_TOKENS for o in outputs), name
    tokens = len(PROMPTS) * OUTPUT_TOKENS
    for name, spent in times.items():
        best = min(spent)
        median = statistics.median(spent)
        print(f"{name:8s} best {best:.2f} s, median {median:.2f} s: {tokens / best:.1f} tok/s")
    llm.shutdown()


if __name__ == "__main__":
    main()
