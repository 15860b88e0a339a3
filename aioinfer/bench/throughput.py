"""`aioinfer bench throughput`: an offline workload through `LLM`, and optionally the same one
through transformers' batched `generate` in the same run, on the same weights.

Prompts are random token ids (seeded), every request generates exactly `output_len` tokens
(EOS ignored), decoding is greedy. Throughput counts output tokens (and all tokens) over the
wall time of the whole batch, prefill included, as vLLM's `bench throughput` does. With
`rounds`, the two engines run in turn that many times (a fresh engine of ours each round, so no
round finds the last one's prompts cached) and the table gives each round's ratio and their
median: on a shared machine one run's ratio can move by a third.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class ThroughputResult:
    engine: str
    num_prompts: int
    input_tokens: int
    output_tokens: int
    seconds: float
    round: int = 1

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }


def make_workload(
    num_prompts: int,
    input_len: int | tuple[int, int],
    output_len: int | tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs; a (lo, hi) length is drawn uniformly per prompt."""
    rng = random.Random(seed)

    def draw(length: int | tuple[int, int]) -> int:
        return rng.randint(*length) if isinstance(length, tuple) else length

    # Stay clear of the first ids, which are special tokens in most vocabularies.
    return [
        ([rng.randrange(100, vocab_size) for _ in range(draw(input_len))], draw(output_len))
        for _ in range(num_prompts)
    ]


def run_ours(llm: Any, workload: list[tuple[list[int], int]]) -> ThroughputResult:
    from aioinfer.core.sampling_params import SamplingParams

    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputResult("aioinfer", len(prompts), sum(map(len, prompts)), generated, seconds)


def copy_weights(llm: Any) -> tuple[Any, dict[str, Any]]:
    """The HF config and a copy of the weights our runner loaded, for the transformers peer."""
    runner_model = llm.engine.gpu.call(lambda: llm.engine.gpu.runner.model).result()
    state = {k: v.detach().clone() for k, v in runner_model.state_dict().items()}
    from aioinfer.model.loader.resolved import own_class_config

    return own_class_config(runner_model.hf_config), state


def run_transformers(
    hf_config: Any, state: dict[str, Any], workload: list[tuple[list[int], int]], batch_size: int
) -> ThroughputResult:
    """transformers' `generate` on the same weights as ours, left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM

    device = next(iter(state.values())).device
    # Built for real, not on meta: its rotary buffers must be initialised.
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=next(iter(state.values())).dtype)
    hf.load_state_dict(state, strict=False)
    hf.eval()
    pad = 0
    generated, input_tokens = 0, 0
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        max_new = max(n for _, n in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device
        )
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
        # Requested tokens only, as vLLM counts its hf backend: a batch's padding to its
        # longest output is the peer's waste, not its throughput.
        produced = out.shape[1] - width
        generated += sum(min(n, produced) for _, n in batch)
        input_tokens += sum(len(p) for p, _ in batch)
    seconds = time.perf_counter() - start
    return ThroughputResult("transformers", len(workload), input_tokens, generated, seconds)


def print_table(results: list[ThroughputResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Offline throughput")
    columns = ("round", "engine", "prompts", "in tok", "out tok", "seconds", "out tok/s",
               "total tok/s")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            str(r.round), r.engine, str(r.num_prompts), str(r.input_tokens), str(r.output_tokens),
            f"{r.seconds:.1f}", f"{r.output_tokens_per_s:.1f}", f"{r.total_tokens_per_s:.1f}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    ours = [r for r in results if r.engine == "aioinfer"]
    peers = [r for r in results if r.engine != "aioinfer"]
    if peers:
        pairs = zip(ours, peers, strict=True)
        ratios = [a.output_tokens_per_s / b.output_tokens_per_s for a, b in pairs]
        each = "; ".join(f"{ratio:.2f}x" for ratio in ratios)
        median = f" (median {statistics.median(ratios):.2f}x)" if len(ratios) > 1 else ""
        console.print(f"aioinfer / {peers[0].engine} output throughput: {each}{median}")


def main(
    model: str,
    num_prompts: int,
    input_len: str,
    output_len: str,
    vs: str | None,
    hf_batch_size: int,
    seed: int,
    result_file: str | None,
    options: dict[str, Any],
    rounds: int = 1,
) -> list[ThroughputResult]:
    """Ours, then the peer's, `rounds` times; the results in that order."""
    from aioinfer.offline.llm import LLM

    if vs not in (None, "transformers"):
        raise ValueError(f"--vs must be 'transformers', got {vs!r}")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    results: list[ThroughputResult] = []
    peer = None
    for round_ in range(1, rounds + 1):
        first = len(results)
        llm = LLM(model, **options)
        try:
            vocab = llm.engine.info.vocab_size
            workload = make_workload(
                num_prompts, _parse_len(input_len), _parse_len(output_len), vocab, seed
            )
            # One short warm-up request, so one-time costs do not count.
            run_ours(llm, workload[:1])
            results.append(run_ours(llm, workload))
            if vs == "transformers" and peer is None:
                peer = copy_weights(llm)
        finally:
            llm.shutdown()  # frees our KV cache before the peer runs
        if peer is not None:
            # On a thread that ends: torch's OpenMP team on a thread that lives on (here, the
            # caller's) would leave libgomp more threads than CPUs, so that in later rounds our
            # engine's threads sleep at every barrier instead of spinning (1.5-2x slower steps).
            with ThreadPoolExecutor(max_workers=1) as peer_thread:
                run = peer_thread.submit(run_transformers, *peer, workload, hf_batch_size)
                results.append(run.result())
        for result in results[first:]:
            result.round = round_
    print_table(results)
    if result_file:
        with open(result_file, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=2)
    return results


def _parse_len(value: str) -> int | tuple[int, int]:
    """ "128" or a uniform range "100:1024"."""
    if ":" in value:
        lo, hi = value.split(":", 1)
        return int(lo), int(hi)
    return int(value)
