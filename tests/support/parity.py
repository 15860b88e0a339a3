"""Comparing two runs' logits where bfloat16 makes exact tokens the wrong check, and the
teacher-forced runs of a model runner that give them.

With random weights (`--load-format dummy`: N(0, 0.02)) and a 151936-token vocabulary, a
step's best two logits are often closer together than bfloat16 rounds, and cuBLAS picks its
GEMM algorithm (so its reduction order) by the number of rows. A CUDA graph replayed at a
padded bucket (11 requests run as 16), or another attention backend, changes the low bits of
the logits, and greedy tokens part ways within tens of steps although both runs are right.
Exact tokens are a valid check only where the same kernels run the same shapes (graphs at
the bucket sizes 1, 2, 4, 8, 16 against eager). Elsewhere, feed both runs the same tokens
(teacher forcing) and compare each step's logits:

- the largest absolute difference, relative to the largest reference logit (the scale);
- the fraction of rows whose top-1 token agrees;
- where it does not, how far below its own best the reference rates the other run's pick:
  within a tie tolerance it is a near tie that rounding may flip; beyond it, a real
  disagreement that no rounding explains. (If every logit differs by at most d, a flip is
  only possible where the two candidates were within 2 d: the tie tolerance is the tighter
  test where the largest difference comes from a few entries.)

`compare_logits` makes the report, `assert_parity` checks it. `teacher_forced` drives a
`ModelRunner` directly, without the scheduler, on the GPU thread (`llm.engine.gpu.call`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aioinfer.model.forward_context import forward_context
from aioinfer.model.layers.attention import AttentionMetadata

# Relative to the scale (the largest reference logit). bfloat16 keeps 8 significant bits: one
# rounding moves a logit by up to 0.4 % of it. Measured on the CPU, teacher-forced, on a 2-layer
# model of Qwen2.5-1.5B's shape with dummy weights (logits up to ~4.6): bfloat16 against float32,
# and the torch attention backend against the triton kernels, both in bfloat16, differ by at
# most 1.2-1.3 % of the scale; 2-4 % of the rows flip top-1, every flip between candidates
# within 0.8 % of each other; the difference of the errors of a row's best two logits has a
# standard deviation of 0.3 % of the scale (the tie tolerance is 6 of them). The bounds leave
# 4x room and more; a wrong kernel or replay is off by tens of percent and picks unrelated
# tokens.
DEFAULT_TIE_RTOL = 0.02
DEFAULT_MAX_REL_DIFF = 0.05
DEFAULT_MIN_TOP1 = 0.9

Logits = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class ParityReport:
    """How far `out` is from `ref`, over rows of logits (one row per request and step)."""

    rows: int
    scale: float  # the largest |reference logit|
    max_abs_diff: float  # the largest |out - ref| over every logit
    top1_agreement: float  # fraction of rows whose argmax agrees
    tie_flips: int  # rows that disagree between near-tied candidates
    real_flips: int  # rows that disagree beyond the tie tolerance
    worst_flip_gap: float  # the largest gap among disagreeing rows, relative to the scale
    tie_rtol: float  # the tie tolerance, relative to the scale
    real_flip_rows: tuple[int, ...] = field(default=())  # the first few, for the message

    @property
    def rel_diff(self) -> float:
        return self.max_abs_diff / self.scale

    @property
    def near_tie_fraction(self) -> float:
        """Of the rows whose top-1 disagrees, the fraction that are near ties (1 when none)."""
        flips = self.tie_flips + self.real_flips
        return 1.0 if flips == 0 else self.tie_flips / flips

    def __str__(self) -> str:
        return (
            f"{self.rows} rows: max |diff| {self.max_abs_diff:.4g} = {self.rel_diff:.3%} of the "
            f"scale {self.scale:.4g}; top-1 agrees in {self.top1_agreement:.1%}; "
            f"{self.tie_flips} flips within the tie tolerance ({self.tie_rtol:.1%} of the "
            f"scale), {self.real_flips} beyond it (rows {list(self.real_flip_rows)}); "
            f"worst flip gap {self.worst_flip_gap:.3%} of the scale"
        )


def _rows(logits: Logits) -> torch.Tensor:
    """[..., V] logits (a tensor, or a sequence of same-shaped ones) as float32 [rows, V]."""
    tensor = logits if isinstance(logits, torch.Tensor) else torch.stack(list(logits))
    return tensor.detach().float().reshape(-1, tensor.shape[-1])


def compare_logits(ref: Logits, out: Logits, *, tie_rtol: float = DEFAULT_TIE_RTOL) -> ParityReport:
    """Compare logits of the same inputs: each a tensor [steps, B, V] (or [rows, V]) or a
    sequence of [B, V] tensors, one per step. `tie_rtol`: a row whose top-1 differs is a near
    tie when the reference rates `out`'s pick within tie_rtol * scale of its own best."""
    r = _rows(ref)
    o = _rows(out).to(r.device)
    if r.shape != o.shape:
        raise ValueError(f"ref and out must have the same shape, got {r.shape} and {o.shape}")
    if r.numel() == 0:
        raise ValueError("no logits to compare")
    scale = float(r.abs().max())
    scale = scale if scale > 0 else 1.0
    max_abs_diff = float((o - r).abs().max())  # NaN anywhere makes it NaN
    ref_top = r.argmax(-1)
    out_top = o.argmax(-1)
    flips = ref_top != out_top
    # How much lower the reference rates out's pick than its own best (>= 0; NaN if NaN).
    gaps = (r.gather(1, ref_top[:, None]) - r.gather(1, out_top[:, None])).squeeze(1) / scale
    near = gaps <= tie_rtol  # False for NaN: a NaN row counts as a real flip
    real = flips & ~near
    # A NaN in out moves its argmax onto the NaN: a flip whose gap may be small, but real.
    real |= o.isnan().any(-1)
    tie = flips & ~real
    return ParityReport(
        rows=r.shape[0],
        scale=scale,
        max_abs_diff=max_abs_diff,
        top1_agreement=float((~flips).float().mean()),
        tie_flips=int(tie.sum()),
        real_flips=int(real.sum()),
        worst_flip_gap=float(gaps[flips].max()) if bool(flips.any()) else 0.0,
        tie_rtol=tie_rtol,
        real_flip_rows=tuple(int(i) for i in real.nonzero().flatten()[:8]),
    )


def assert_parity(
    report: ParityReport,
    *,
    max_rel_diff: float = DEFAULT_MAX_REL_DIFF,
    min_top1: float = DEFAULT_MIN_TOP1,
    max_real_flips: int = 0,
) -> None:
    """Raise AssertionError, with the report, unless the logits agree to bfloat16's precision:
    the largest difference within max_rel_diff of the scale, top-1 agreement of at least
    min_top1, and at most max_real_flips disagreements beyond the tie tolerance."""
    problems = []
    if not report.rel_diff <= max_rel_diff:  # also when NaN
        problems.append(f"max |diff| above {max_rel_diff:.2%} of the scale")
    if not report.top1_agreement >= min_top1:
        problems.append(f"top-1 agreement below {min_top1:.0%}")
    if report.real_flips > max_real_flips:
        problems.append(f"more than {max_real_flips} top-1 flips beyond the tie tolerance")
    if problems:
        raise AssertionError("; ".join(problems) + f"\n{report}")


# --- teacher-forced runs of a ModelRunner -------------------------------------------------------


@dataclass
class ForcedRun:
    """Logits of a teacher-forced run, float32 on the CPU."""

    prefill: torch.Tensor  # [B, V]: at each prompt's last token
    decode: dict[str, list[torch.Tensor]]  # per path, one [B, V] per decode step
    tokens: list[list[int]]  # tokens[t][i]: the token request i was fed at decode step t

    def logits(self, path: str = "eager") -> list[torch.Tensor]:
        """The prefill's logits, then each decode step's through `path`."""
        return [self.prefill, *self.decode[path]]


def block_tables(
    lengths: Sequence[int], block_size: int, num_blocks: int, seed: int = 0
) -> list[tuple[int, ...]]:
    """Blocks for requests of `lengths` tokens, drawn in shuffled order from 1 .. num_blocks - 1
    (block 0 is the null block), so a kernel that ignores the block table reads wrong data."""
    needed = [-(-n // block_size) for n in lengths]
    if sum(needed) > num_blocks - 1:
        raise ValueError(f"{sum(needed)} blocks needed, the cache has {num_blocks - 1} to give")
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = []
    for n in needed:
        tables.append(tuple(free[:n]))
        del free[:n]
    return tables


def forward_logits(
    runner: Any,
    token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    tables: Sequence[Sequence[int]],
    *,
    graph: bool = False,
) -> torch.Tensor:
    """One forward of request i's `token_ids[i]` at positions starts[i].. through `runner`'s
    model over its KV cache (as runner.execute runs a step, the sampler aside): float32 logits
    [B, V] at each request's last token. `graph`: replay the CUDA graph of the padded bucket
    (a decode-only step) instead of running eagerly."""
    cache = runner.kv_caches[0]
    block_size, device = cache.shape[2], cache.device
    metadata = AttentionMetadata.build(
        [len(t) for t in token_ids], list(starts), [list(t) for t in tables], block_size, device
    )
    flat = [t for ids in token_ids for t in ids]
    input_ids = torch.tensor(flat, dtype=torch.long).to(device)
    if graph:
        graphs = runner.graph_runner
        if graphs is None or not metadata.decode_only or not graphs.can_run(len(token_ids)):
            raise ValueError("a graph replay needs captured graphs and a decode-only step")
        hidden = graphs.replay(input_ids, metadata.positions, metadata)
    else:
        with forward_context(metadata, runner.kv_caches, runner.attn_backend):
            hidden = runner.model(input_ids, metadata.positions)
    last = torch.tensor(metadata.query_start_loc_host[1:], dtype=torch.long) - 1
    return runner.model.compute_logits(hidden.index_select(0, last.to(device))).float()


def teacher_forced(
    runner: Any,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    paths: Sequence[str] = ("eager",),
    forced: Sequence[Sequence[int]] | None = None,
    seed: int = 0,
) -> ForcedRun:
    """Prefill `prompts` eagerly, then run `steps` decode steps, each through every one of
    `paths` ("eager", "graph") with the same inputs; call it on the runner's thread.

    Each decode step is fed `forced[t]`, or when None the argmax of the previous step's logits
    through paths[0] (the prefill's for the first). The paths of a step write its K/V into the
    same slots (the last path's stay), so every path computes the step over the same context
    and differences do not compound. Blocks are taken from 1 .. num_blocks - 1 regardless of
    the engine's block manager: run it on an engine with no request in flight, and expect its
    prefix cache to hold garbage afterwards."""
    if not paths or len(set(paths)) != len(paths) or not set(paths) <= {"eager", "graph"}:
        raise ValueError(f"paths must name 'eager' and/or 'graph' once each, got {paths!r}")
    if forced is not None and len(forced) < steps:
        raise ValueError(f"forced holds {len(forced)} steps, {steps} asked for")
    cache = runner.kv_caches[0]
    lengths = [len(p) + steps for p in prompts]
    tables = block_tables(lengths, cache.shape[2], cache.shape[0], seed)
    with torch.inference_mode():
        prefill = forward_logits(runner, prompts, [0] * len(prompts), tables)
        feed = prefill.argmax(-1).tolist()
        decode: dict[str, list[torch.Tensor]] = {path: [] for path in paths}
        tokens: list[list[int]] = []
        for t in range(steps):
            if forced is not None:
                feed = list(forced[t])
            tokens.append(feed)
            starts = [len(p) + t for p in prompts]
            for path in paths:
                logits = forward_logits(
                    runner, [[x] for x in feed], starts, tables, graph=path == "graph"
                )
                decode[path].append(logits.cpu())
            feed = decode[paths[0]][-1].argmax(-1).tolist()
    return ForcedRun(prefill.cpu(), decode, tokens)
