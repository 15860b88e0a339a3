"""Embedding throughput: our pooling runner (`LLM.embed`) against transformers on the same
weights, the way sentence-transformers batches (inputs sorted by length, batches of 32, right
padding with an attention mask, last-token pooling, L2 normalization). Alternating rounds; the
median of each, in input tokens per second, and the largest difference between the vectors.

The peer computes the same vectors as ours (the check prints their largest difference); it pads
each batch to its longest input, which is the waste a token-budget scheduler avoids.

Run: .venv/bin/python scripts/bench_embed.py [--num-prompts 128 --min-len 16 --max-len 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from aioinfer import LLM
from aioinfer.bench.throughput import copy_weights


def run_ours(llm: LLM, prompts: list[list[int]]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    outputs = llm.embed(prompts, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, np.stack([o.outputs.data for o in outputs])


@torch.inference_mode()
def run_transformers(
    decoder: torch.nn.Module, prompts: list[list[int]], batch_size: int
) -> tuple[float, np.ndarray]:
    vectors: list[np.ndarray | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([prompts[i] + [0] * (width - len(prompts[i])) for i in batch])
        mask = torch.tensor(
            [[1] * len(prompts[i]) + [0] * (width - len(prompts[i])) for i in batch]
        )
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        last = mask.sum(1) - 1
        pooled = torch.nn.functional.normalize(hidden[torch.arange(len(batch)), last], dim=-1)
        for row, i in enumerate(batch):
            vectors[i] = pooled[row].numpy()
    return time.perf_counter() - start, np.stack(vectors)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="the peer's batch size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(args.model, runner="pooling", enable_prefix_caching=False)
    vocab = llm.engine.info.vocab_size
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_prompts)
    ]
    num_tokens = sum(map(len, prompts))
    hf_config, state = copy_weights(llm)
    from transformers import AutoModelForCausalLM

    peer = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    peer.load_state_dict(state, strict=False)
    decoder = peer.model.eval()
    run_ours(llm, prompts[:4])  # warm-up: first-call allocations on both sides
    run_transformers(decoder, prompts[:4], args.batch_size)
    ours, theirs = [], []
    for _ in range(args.rounds):
        seconds, ours_vectors = run_ours(llm, prompts)
        ours.append(seconds)
        seconds, peer_vectors = run_transformers(decoder, prompts, args.batch_size)
        theirs.append(seconds)
    llm.shutdown()
    diff = float(np.abs(ours_vectors - peer_vectors).max())
    ours_rate = num_tokens / statistics.median(ours)
    peer_rate = num_tokens / statistics.median(theirs)
    print(
        f"{args.num_prompts} prompts, {num_tokens} tokens (U[{args.min_len}, {args.max_len}]), "
        f"{args.rounds} alternating rounds, medians"
    )
    print(f"transformers, batches of {args.batch_size}: {peer_rate:8.1f} input tok/s {theirs}")
    print(f"aioinfer LLM.embed:           {ours_rate:8.1f} input tok/s {ours}")
    print(f"ratio {ours_rate / peer_rate:.2f}x; largest difference between the vectors {diff:.2e}")


if __name__ == "__main__":
    main()
