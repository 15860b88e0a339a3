"""What speculative decoding by prompt lookup gives and costs: the bundled SmolLM2 offline, one
engine without drafts and one with them, side by side, three alternating rounds each; the
median wall time per workload and whether the outputs were the same tokens.

Workloads:
- copy: one chat request that repeats a 170-word passage (greedy, up to 320 tokens): the case
  drafts are for (quotes, edits, extraction, code that repeats its context);
- copy-sampled: the same at temperature 0.7, seeded;
- story: one open-ended request (greedy, 128 tokens): little to look up;
- random x16: 16 prompts of 128 random tokens -> 128 greedy tokens, EOS ignored: drafts that
  rarely match, in a batch where the step is no longer bound by reading the weights.

Run: .venv/bin/python scripts/bench_spec.py [--num-speculative-tokens 4 --prompt-lookup-min 2
--prompt-lookup-max 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from aioinfer import LLM, SamplingParams

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers "
    "had climbed the same one hundred and twelve steps each evening to light the lamp. The last "
    "keeper, a quiet woman named Ada Morrow, kept a logbook in which she wrote the weather, the "
    "ships that passed, and the birds that rested on the gallery rail. When the light was "
    "automated in the spring of 1987, she left the logbook on the desk by the window, closed "
    "the door behind her, and walked down the spit without looking back. Visitors who climb the "
    "steps today can still read her final entry: wind from the west, a clear sky, two fishing "
    "boats heading home, and a single gull that would not leave the rail."
)


def workloads(tokenizer, seed: int = 0) -> dict[str, tuple[list, SamplingParams, bool]]:
    """name -> (prompts, params, chat)."""
    copy = [[{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}]]
    story = [
        [{"role": "user", "content": "Write a short story about a dragon who learns to cook."}]
    ]
    rng = random.Random(seed)
    vocab = len(tokenizer)
    random_prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(128)]} for _ in range(16)
    ]
    return {
        "copy": (copy, SamplingParams(temperature=0, max_tokens=320), True),
        "copy-sampled": (copy, SamplingParams(temperature=0.7, seed=3, max_tokens=320), True),
        "story": (story, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), True),
        "random x16": (
            random_prompts,
            SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
            False,
        ),
    }


def run(llm: LLM, prompts: list, params: SamplingParams, chat: bool) -> tuple[float, list]:
    start = time.perf_counter()
    if chat:
        outputs = llm.chat(prompts, params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    # No prefix caching: each round recomputes its prompts, as a new request would.
    options = {"dtype": "float32", "kv_cache_memory": 1.0, "max_model_len": 1024,
               "enable_prefix_caching": False}  # fmt: skip
    engines = {"plain": LLM(**options), "ngram": LLM(**options, speculative_config=spec)}
    cases = workloads(engines["plain"].get_tokenizer())
    print(f"speculative_config: {spec}")
    print(
        "| workload | output tokens | plain tok/s | ngram tok/s | ratio | same tokens "
        "| accepted / drafted |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (prompts, params, chat) in cases.items():
        for llm in engines.values():
            run(llm, prompts[:1], params, chat)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in engines}
        tokens: dict[str, list] = {}
        stats = engines["ngram"].engine.scheduler.spec_stats
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        for _ in range(args.rounds):
            for key, llm in engines.items():
                elapsed, tokens[key] = run(llm, prompts, params, chat)
                times[key].append(elapsed)
        num_tokens = sum(len(t) for t in tokens["plain"])
        rate = {k: sum(map(len, tokens[k])) / statistics.median(v) for k, v in times.items()}
        print(
            f"| {name} | {num_tokens} | {rate['plain']:.1f} | {rate['ngram']:.1f} | "
            f"{rate['ngram'] / rate['plain']:.2f}x | {tokens['plain'] == tokens['ngram']} | "
            f"{stats.num_accepted_tokens - accepted} / {stats.num_draft_tokens - drafted} |"
        )
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
