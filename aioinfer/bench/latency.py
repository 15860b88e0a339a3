"""`aioinfer bench latency`: batch-1 time to first token (TTFT) and time per output token (TPOT)
through the offline `LLM`, beside the memory-bandwidth floor of a decode step.

TTFT for batch 1 is the wall time of a request for one token (prefill and one sample); TPOT is
(time of a request for N tokens - TTFT) / (N - 1). Both use the medians over the iterations,
which alternate the two requests so that both see the same machine. Prefix caching is off by
default: the same prompt repeats, and a cache hit would skip the prefill being measured.

The floor: a batch-1 decode step reads every weight once (an embedding table only for one row,
unless the LM head shares it), so it takes at least weight bytes / memory bandwidth. Bandwidth is
measured on the model's device with a large tensor copy, counting bytes read plus written, the
median of a few repetitions.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

MiB = 1024 * 1024


@dataclass
class LatencyResult:
    model: str
    device: str
    dtype: str
    input_len: int
    output_len: int
    ttft_s: list[float]  # one per iteration: a max_tokens=1 request
    e2e_s: list[float]  # one per iteration: a max_tokens=output_len request
    weight_bytes: int  # read by one batch-1 decode step
    bandwidth_bytes_per_s: float

    @property
    def ttft_median_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def e2e_median_s(self) -> float:
        return statistics.median(self.e2e_s)

    @property
    def tpot_s(self) -> float:
        return (self.e2e_median_s - self.ttft_median_s) / (self.output_len - 1)

    @property
    def floor_tpot_s(self) -> float:
        return self.weight_bytes / self.bandwidth_bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ttft_median_s": self.ttft_median_s,
            "e2e_median_s": self.e2e_median_s,
            "tpot_s": self.tpot_s,
            "floor_tpot_s": self.floor_tpot_s,
            "decode_tokens_per_s": 1.0 / self.tpot_s if self.tpot_s > 0 else None,
            "ceiling_tokens_per_s": 1.0 / self.floor_tpot_s,
        }


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters one batch-1 decode step reads. Each parameter counts once (tied
    weights are one object); a table used only by embedding layers counts one row; a linear
    held in more than one form (packed_weights.py) counts its codes."""
    from torch import nn

    users: dict[int, tuple[Any, bool]] = {}
    for module in model.modules():
        # A native linear with byte codes beside its float32 strips or its weight parts reads
        # the codes at batch 1: the other forms serve steps of many rows.
        coded = getattr(module, "codes", None) is not None
        other_forms = [getattr(module, "packed", None), getattr(module, "parts", None)]
        for param in module.parameters(recurse=False):
            if coded and any(param is form for form in other_forms):
                continue
            _, only_embeddings = users.get(id(param), (param, True))
            users[id(param)] = (param, only_embeddings and isinstance(module, nn.Embedding))
    total = 0
    for param, only_embeddings in users.values():
        elements = param[0].numel() if only_embeddings else param.numel()
        total += elements * param.element_size()
    return total


def measure_bandwidth(device: torch.device, size_mib: int = 1024, reps: int = 7) -> float:
    """Copy bandwidth in bytes/s (read + write) of a float32 tensor of size_mib, median of reps."""
    import torch

    elements = _fit_device(device, size_mib * MiB) // 4
    source = torch.ones(elements, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch of the pages, not timed
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    del source, target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * elements * 4 / statistics.median(times)


def _fit_device(device: torch.device, size: int) -> int:
    """size, shrunk so that two tensors of it fit in the free memory of a GPU (the KV cache
    holds most of it); at least 64 MiB, still far beyond any cache."""
    import torch

    if device.type != "cuda":
        return size
    free, _ = torch.cuda.mem_get_info(device)
    return max(64 * MiB, min(size, free // 3))


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_facts(llm: Any, size_mib: int, reps: int) -> tuple[int, str, str, float]:
    """(weight bytes, device, dtype, bandwidth), measured on the GPU thread that owns them."""

    def measure() -> tuple[int, str, str, float]:
        runner = llm.engine.gpu.runner
        bandwidth = measure_bandwidth(runner.device, size_mib, reps)
        return weight_bytes(runner.model), str(runner.device), str(runner.dtype), bandwidth

    facts: tuple[int, str, str, float] = llm.engine.gpu.call(measure).result()
    return facts


def time_request(llm: Any, prompt_ids: list[int], max_tokens: int) -> float:
    """Wall time of one greedy request that generates exactly max_tokens tokens."""
    from aioinfer.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    output = llm.generate([prompt_ids], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    generated = len(output.outputs[0].token_ids)
    if generated != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {generated}")
    return seconds


def prompt_ids(llm: Any, input_len: int, prompt: str | None, seed: int) -> list[int]:
    """The prompt's token ids, or input_len seeded random ids clear of the special tokens that
    sit at the start of most vocabularies."""
    if prompt is not None:
        return list(llm.get_tokenizer().encode(prompt))
    vocab = llm.engine.info.vocab_size
    rng = random.Random(seed)
    low = min(100, vocab // 4)
    return [rng.randrange(low, vocab) for _ in range(input_len)]


def measure(
    llm: Any, ids: list[int], output_len: int, iterations: int, warmup: int
) -> tuple[list[float], list[float]]:
    """(TTFT samples, full-request samples), after uncounted warm-up pairs."""
    for _ in range(warmup):
        time_request(llm, ids, 1)
        time_request(llm, ids, output_len)
    ttfts, e2es = [], []
    for _ in range(iterations):
        ttfts.append(time_request(llm, ids, 1))
        e2es.append(time_request(llm, ids, output_len))
    return ttfts, e2es


def run(
    llm: Any,
    model: str,
    input_len: int = 128,
    output_len: int = 128,
    iterations: int = 5,
    warmup: int = 1,
    prompt: str | None = None,
    seed: int = 0,
    bandwidth_mib: int = 1024,
    bandwidth_reps: int = 7,
) -> LatencyResult:
    """The benchmark on an existing LLM."""
    _check_args(input_len, output_len, iterations, warmup, bandwidth_mib, bandwidth_reps)
    ids = prompt_ids(llm, input_len, prompt, seed)
    max_len = llm.engine.info.max_model_len
    if len(ids) + output_len > max_len:
        raise ValueError(
            f"input_len + output_len must be <= max_model_len ({max_len}), "
            f"got {len(ids)} + {output_len}"
        )
    ttfts, e2es = measure(llm, ids, output_len, iterations, warmup)
    size, device, dtype, bandwidth = _device_facts(llm, bandwidth_mib, bandwidth_reps)
    return LatencyResult(model, device, dtype, len(ids), output_len, ttfts, e2es, size, bandwidth)


def _check_args(
    input_len: int,
    output_len: int,
    iterations: int,
    warmup: int,
    bandwidth_mib: int,
    bandwidth_reps: int,
) -> None:
    minimums = {
        "input_len": (input_len, 1),
        "output_len": (output_len, 2),  # TPOT needs a second token
        "num_iters": (iterations, 1),
        "num_iters_warmup": (warmup, 0),
        "bandwidth_mib": (bandwidth_mib, 1),
        "bandwidth_reps": (bandwidth_reps, 1),
    }
    for name, (value, least) in minimums.items():
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")


def print_report(result: LatencyResult) -> None:
    from rich.console import Console
    from rich.table import Table

    floor_ms = result.floor_tpot_s * 1000
    table = Table(
        title=(
            f"Batch-1 latency: {result.model or 'bundled SmolLM2-135M-Instruct'} on "
            f"{result.device} ({result.dtype}), {result.input_len} prompt tokens -> "
            f"{result.output_len}, median of {len(result.ttft_s)}"
        )
    )
    for column in ("metric", "measured", "bandwidth floor", "measured / floor"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    tpot_ms = result.tpot_s * 1000
    table.add_row("TTFT (ms)", f"{result.ttft_median_s * 1000:.2f}", "", "")
    table.add_row("E2E (ms)", f"{result.e2e_median_s * 1000:.2f}", "", "")
    table.add_row("TPOT (ms)", f"{tpot_ms:.3f}", f"{floor_ms:.3f}", f"{tpot_ms / floor_ms:.1f}x")
    decode = f"{1000 / tpot_ms:.1f}" if tpot_ms > 0 else "-"
    table.add_row("decode tok/s", decode, f"{1000 / floor_ms:.1f}", "")
    console = Console()
    console.print(table)
    console.print(
        f"floor = {result.weight_bytes / 1e6:.1f} MB of weights per step / "
        f"{result.bandwidth_bytes_per_s / 1e9:.1f} GB/s measured copy bandwidth"
    )


def main(
    model: str,
    input_len: int,
    output_len: int,
    num_iters: int,
    num_iters_warmup: int,
    prompt: str | None,
    seed: int,
    result_file: str | None,
    options: dict[str, Any],
    bandwidth_mib: int = 1024,
    bandwidth_reps: int = 7,
) -> LatencyResult:
    from aioinfer.offline.llm import LLM

    _check_args(input_len, output_len, num_iters, num_iters_warmup, bandwidth_mib, bandwidth_reps)
    options = {"enable_prefix_caching": False, **options}
    llm = LLM(model, **options)
    try:
        result = run(
            llm,
            model,
            input_len,
            output_len,
            num_iters,
            num_iters_warmup,
            prompt,
            seed,
            bandwidth_mib,
            bandwidth_reps,
        )
    finally:
        llm.shutdown()
    print_report(result)
    if result_file:
        Path(result_file).write_text(json.dumps(result.as_dict(), indent=2))
    return result
