"""Linear weights held as byte codes with a scale and an offset per run of 32, bit for bit.

A GGUF checkpoint's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K tensors dequantize, in
float32, to `code * scale + offset` over each run of 32 weights along a row (Q4_1: `d * q + m`;
Q4_0: `d * (q - 8) + -0.0`, the -0.0 keeping the sign of a zero weight; Q4_K and Q5_K:
`(d * sc) * q - dmin * m` per sub-block of 32), with codes in [-128, 127] and scales of at most
17 significant bits (a float16, or a float16 times a 6-bit integer). Kept in that form, a
weight takes 1.25 bytes instead of 4, and the CPU kernels decode it in registers to the very
float32 the dequantized tensor holds: the same products, the same sums, the same outputs, from a
third of the memory traffic (see kernels.c, `Weight`).

The form is found from the float32 weights themselves, not from the file's tensor types, so
the cache of converted checkpoints, merged projections and any loader give the same result:
`code_weight` tries the block shapes of ggml's quantizers on each run, rebuilds every weight as
the kernel will and keeps the codes only where all of them come back bit for bit. Anything
else (trained float32 weights, the K-quants with sub-blocks of 16: Q2_K, Q3_K, Q6_K) stays as
float32 strips.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

STRIP = 16  # output columns per strip, as pack_weight's; must match STRIP in kernels.c
CODE_BLOCK = 32  # weights per scale and offset along a row; must match CODE_BLOCK in kernels.c
# Bytes a coded weight takes: its code, and its share of a float32 scale and offset.
CODED_BYTES_PER_WEIGHT = 1 + 2 * 4 / CODE_BLOCK
# GGUF tensor types whose blocks (from ggml's quantizers) dequantize to such codes.
CODED_GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"})
# GGUF tensor types whose code * scale (a float16 times a code of at most 5 bits) splits into
# two bfloat16 parts exactly: their weights also keep parts on AMX (NativeKernels.weight_parts).
PARTS_GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1"})
# Significant bits a scale may have for code * scale to be exact (codes of 7 bits and a sign).
SCALE_BITS = 17
# (runs [R, 32], scale [R], offset [R]) -> (codes [R, 32] int8, whether each run fits [R]).
CodeRuns = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# Rows tried first: a tensor whose first rows do not code is left alone without coding it all.
_SAMPLE_ROWS = 2 * STRIP


@dataclass(frozen=True)
class CodedWeight:
    """A linear weight [N, K] as codes [N / 16, K, 16] (int8, strips as pack_weight's) and
    scales [N / 16, K / 32, 2, 16] (float32: the scale, then the offset, of each column's runs
    of 32 along K); with `strips` (pack_weight's) too, the kernels read the codes for steps of
    few rows and the strips for the rest, each where it is faster; with `amx`, steps of more
    rows read the codes on AMX instead (kernels.c, "AMX linears"; only where the kernels
    have AMX), and with `parts` (NativeKernels.weight_parts) too, steps of the most rows read
    those instead (kernels.c, "AMX linears from weight parts")."""

    codes: torch.Tensor
    scales: torch.Tensor
    strips: torch.Tensor | None = None
    amx: bool = False
    parts: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * STRIP

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        """The bytes a step of few rows reads: the codes and their scales."""
        return self.codes.nbytes + self.scales.nbytes

    def decode(self) -> torch.Tensor:
        """The float32 weight [N, K], as the kernels rebuild it."""
        strips, k, _ = self.codes.shape
        scale = self.scales[:, :, 0].repeat_interleave(CODE_BLOCK, dim=1)  # [N / 16, K, 16]
        offset = self.scales[:, :, 1].repeat_interleave(CODE_BLOCK, dim=1)
        weight = self.codes.to(torch.float32) * scale + offset
        return weight.transpose(1, 2).reshape(strips * STRIP, k)


def code_weight(weight: torch.Tensor, code_runs: CodeRuns) -> CodedWeight | None:
    """`weight` [N, K] (float32) as a CodedWeight that decodes to it bit for bit, or None.
    code_runs: NativeKernels.code_runs, which codes runs under given scales and offsets and
    checks them."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % STRIP or k % CODE_BLOCK or n == 0 or k == 0:
        return None
    runs = weight.detach().reshape(n, k // CODE_BLOCK, CODE_BLOCK)
    sample = _fit(runs[:_SAMPLE_ROWS], _CANDIDATES, code_runs)
    if sample is None:
        return None
    # Usually the sample's candidates fit every run (and trying the rest costs a pass each).
    found = _fit(runs, sample[3], code_runs) or _fit(runs, _CANDIDATES, code_runs)
    if found is None:
        return None
    codes, scale, offset, _ = found
    strips = n // STRIP
    return CodedWeight(
        codes=codes.reshape(strips, STRIP, k).transpose(1, 2).contiguous(),
        scales=torch.stack([scale, offset], dim=-1)  # [N, K / 32, 2]
        .reshape(strips, STRIP, k // CODE_BLOCK, 2)
        .permute(0, 2, 3, 1)
        .contiguous(),
    )


def parts_shape(strips: int, k: int) -> tuple[int, ...]:
    """The shape of a coded weight's parts (NativeKernels.weight_parts), for `strips` strips of
    K = k: int16 [strips, runs, 2, 16, 16, 2], the runs those of K and then the offsets', one
    column a run of K, up to a whole run (split_cols in kernels.c); per strip and run the
    bfloat16 bit patterns of hi, then lo, of code * scale (or the offsets), each [pair of
    k][column][k of the pair] as the tile unit reads them."""
    runs = k // CODE_BLOCK
    return (strips, runs + -(-runs // CODE_BLOCK), 2, CODE_BLOCK // 2, STRIP, 2)


def _symmetric(runs: torch.Tensor, extreme_code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (-8), Q5_0 (-16), Q8_0 (+-127): weight = d * s with signed s, and the weight of
    largest magnitude has s = extreme_code. The offset -0.0 changes no weight but d * 0 with
    d < 0, which it leaves -0.0 (+0.0 would make it +0.0)."""
    index = runs.abs().argmax(dim=-1, keepdim=True)
    scale = runs.gather(-1, index).squeeze(-1) / extreme_code
    return scale, torch.full_like(scale, -0.0)


def _constant(runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of one value v (zeros of either sign included): code 0, offset v, and a zero
    scale of v's sign, so that 0 * scale + v is v, -0.0 too."""
    first = runs[..., 0]
    return first * 0.0, first


def _span(runs: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 and Q4_K (top 15), Q5_1 and Q5_K (top 31): weight = d * q + m with q in [0, top],
    where d and m are float16s (Q4_1, Q5_1), or float16s times 6-bit integers (the K-quants'
    d * sc and -dmin * m): at most 17 significant bits. Where the run's extremes have codes 0
    and top: offset m, the minimum, and scale d, the span over top, to 17 bits."""
    low, high = torch.aminmax(runs, dim=-1)
    return _round_to_bits((high - low) / top, SCALE_BITS), low


def _on_grid(runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs whose extremes are other codes (K-quants fit d and m by least squares over a
    sub-block, and clamp; importance-matrix Q4_1 and Q5_1 blocks): the scale is the span over
    the steps that the run's smallest gap makes of it, to 17 bits, and the offset the minimum,
    read as code 0 (exact wherever the weight there is). Sorts each run, so it comes after the
    candidates that need only the extremes."""
    ordered = torch.from_numpy(np.sort(runs.numpy(), axis=-1))  # torch's sort: 5x slower here
    low, high = ordered[..., 0], ordered[..., -1]
    gaps = ordered.diff(dim=-1)
    smallest = torch.where(gaps > 0, gaps, torch.inf).amin(dim=-1)
    steps = ((high - low) / smallest).round()
    return _round_to_bits((high - low) / steps, SCALE_BITS), low


def _round_to_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 values rounded to `bits` significant bits (half away from zero)."""
    drop = 24 - bits
    raw = x.contiguous().view(torch.int32)
    return ((raw + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


_CANDIDATES = [
    lambda r: _span(r, 15),
    lambda r: _symmetric(r, -8),
    lambda r: _symmetric(r, 127),
    lambda r: _symmetric(r, -127),
    lambda r: _span(r, 31),
    lambda r: _symmetric(r, -16),
    _constant,
    # Tuned quantizers (llama.cpp's with an importance matrix) may put a run's largest weight
    # on another code.
    *(lambda r, code=code: _symmetric(r, code) for code in (7, -7, 6, -6, 15, -15)),
    _on_grid,
]


def _fit(
    runs: torch.Tensor, candidates: list, code_runs: CodeRuns
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list] | None:
    """Codes [N, K] (int8), scale and offset [N, K / 32] that rebuild every run bit for bit,
    each run taking the first candidate that does, and the candidates taken; None if a run
    fits none of them."""
    codes = torch.zeros(runs.shape, dtype=torch.int8)
    scale = torch.zeros(runs.shape[:2])
    offset = torch.zeros(runs.shape[:2])
    todo = torch.ones(runs.shape[:2], dtype=torch.bool)
    taken = []
    for candidate in candidates:
        everything = bool(todo.all())  # no gather and scatter: the usual first candidate
        pending = runs if everything else runs[todo]  # [..., 32]
        if pending.numel() == 0:
            break
        s, o = candidate(pending)
        c, fits = code_runs(pending.reshape(-1, CODE_BLOCK), s.reshape(-1), o.reshape(-1))
        c, fits = c.view(pending.shape), fits.view(pending.shape[:-1])
        if everything and bool(fits.all()):
            return c.reshape(runs.shape[0], -1), s, o, [candidate]
        if fits.any():
            rows = todo.nonzero(as_tuple=True)
            picked = tuple(r[fits.reshape(-1)] for r in rows)
            codes[picked] = c[fits]
            scale[picked], offset[picked] = s[fits], o[fits]
            todo[picked] = False
            taken.append(candidate)
    if todo.any():
        return None
    return codes.reshape(runs.shape[0], -1), scale, offset, taken


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight [N, K] (N a multiple of 16) as strips [N / 16, K, 16], contiguous."""
    n, k = weight.shape
    if n % STRIP:
        raise ValueError(f"out_features must be a multiple of {STRIP}, got {n}")
    return weight.detach().reshape(n // STRIP, STRIP, k).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_weight`: strips [N / 16, K, 16] -> [N, K]."""
    strips, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(strips * STRIP, k)


# A linear weight as the kernels take it: float32 strips from `pack_weight`, or byte codes from
# `code_weight` (above), which rebuild the same floats from 1.25 bytes a weight.
PackedWeight = torch.Tensor | CodedWeight


class WeightStruct(ctypes.Structure):
    """The C `Weight`: strips, or codes and scales (the other pointer(s) NULL)."""

    _fields_ = [
        ("strips", ctypes.c_void_p),
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("amx", ctypes.c_long),
        ("parts", ctypes.c_void_p),
    ]


def packed_shape(packed: PackedWeight) -> tuple[int, int]:
    """(out_features, in_features) of a packed or coded weight."""
    if isinstance(packed, CodedWeight):
        return packed.out_features, packed.in_features
    return packed.shape[0] * STRIP, packed.shape[1]


def weight_struct(packed: PackedWeight) -> WeightStruct:
    """The C view of a packed or coded weight, after checking its layout (the kernels trust it)."""
    if isinstance(packed, CodedWeight):
        codes, scales, strips = packed.codes, packed.scales, packed.strips
        num_strips, k = codes.shape[:2]
        if codes.dtype != torch.int8 or not codes.is_contiguous() or codes.shape[2] != STRIP:
            raise ValueError(f"codes must be contiguous int8 [N / {STRIP}, K, {STRIP}]")
        check_float32(scales)
        if k % CODE_BLOCK or tuple(scales.shape) != (num_strips, k // CODE_BLOCK, 2, STRIP):
            raise ValueError(
                f"coded weight of {tuple(codes.shape)} needs K % {CODE_BLOCK} == 0 and scales "
                f"{(num_strips, k // CODE_BLOCK, 2, STRIP)}, got {tuple(scales.shape)}"
            )
        if strips is not None:
            _check_strips(strips)
            if tuple(strips.shape) != tuple(codes.shape):
                raise ValueError(
                    f"strips {tuple(strips.shape)} and codes {tuple(codes.shape)} differ"
                )
        strips_pointer = None if strips is None else strips.data_ptr()
        parts = packed.parts
        if parts is not None:
            shape = parts_shape(num_strips, k)
            if parts.dtype != torch.int16 or not parts.is_contiguous() or parts.shape != shape:
                raise ValueError(f"weight parts must be contiguous int16 {shape}")
            if not packed.amx:
                raise ValueError("weight parts are read on AMX only: set amx")
        return WeightStruct(
            strips_pointer,
            codes.data_ptr(),
            scales.data_ptr(),
            packed.amx,
            None if parts is None else parts.data_ptr(),
        )
    _check_strips(packed)
    return WeightStruct(packed.data_ptr(), None, None, 0, None)


def _check_strips(strips: torch.Tensor) -> None:
    check_float32(strips)
    if strips.dim() != 3 or strips.shape[2] != STRIP:
        raise ValueError(
            f"packed weight must be [N / {STRIP}, K, {STRIP}], got {tuple(strips.shape)}"
        )


def check_float32(*tensors: torch.Tensor) -> None:
    """The kernels read raw float32 memory: refuse anything else rather than misread it."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"native CPU kernels take contiguous float32 CPU tensors, got {t.dtype} on "
                f"{t.device}, contiguous={t.is_contiguous()}"
            )
