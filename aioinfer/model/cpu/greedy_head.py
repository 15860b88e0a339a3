"""The exact greedy LM head of the CPU path: each row's argmax of the float32 logits without
computing them all.

A greedy row needs one number from the LM head, the index of its largest logit, yet the head
is a quarter of a decode step's arithmetic. `greedy_head` in kernels.c screens every
column with bfloat16 dot products (AVX512-BF16: twice the float32 FMA rate, half the bytes),
bounds the screen's error from the rows' norms, and recomputes in float32 only the 16-column
strips that could hold the maximum, with the same chain of FMAs as `packed_linear`: the result
is the index that `packed_linear` and an argmax would give, bit for bit, ties included. Rows
the bound cannot settle (too many strips within reach, values near the float range) come back
as None and take the full head.
"""

from __future__ import annotations

import torch

from aioinfer.model.cpu.kernels import STRIP, NativeKernels
from aioinfer.model.cpu.packed_weights import unpack_weight

# Strips a row may leave for float32 before the full head is cheaper: each is K x 16 floats of
# weights read again (on SmolLM2's real rows the median is 1, the mean about 5).
MAX_STRIPS = 64
# Rows screened per kernel call, which bounds the scratch of screened logits (ROWS x V floats).
ROWS = 64
# The scratch holds whole AMX tiles of rows (the kernel screens on AMX where the CPU has it).
TILE_ROWS = 16
# Rows of W converted at a time when building: float64 norms of a whole large vocabulary would
# take gigabytes.
_BUILD_ROWS = 4096


class GreedyHead:
    """The screen of one packed LM head: its weight as bfloat16 pairs and its rows' norms.
    Build with `GreedyHead.build`; called from one thread at a time (the model's)."""

    def __init__(
        self,
        packed: torch.Tensor,
        pairs: torch.Tensor,
        norms: torch.Tensor,
        kernels: NativeKernels,
    ) -> None:
        strips, k, _ = packed.shape
        self.packed, self.pairs, self.norms, self.kernels = packed, pairs, norms, kernels
        self.in_features, self.vocab_size = k, strips * STRIP
        self.norm_max = float(norms.max())  # inf where a norm overflows: every row then fails
        self._scratch = torch.empty(0)
        self._x_pairs = torch.empty(0, dtype=torch.int32)

    @classmethod
    def build(cls, packed: torch.Tensor, kernels: NativeKernels) -> GreedyHead | None:
        """The screen of the LM head `packed` (pack_weight's strips), or None where this CPU
        lacks AVX512-BF16 or the head does not fit the kernel: an odd width, an odd number of
        strips (the screen takes two at a time), weights that bfloat16 cannot hold."""
        strips, k, _ = packed.shape
        if not kernels.has_greedy_head or k % 2 or strips % 2:
            return None
        weight = unpack_weight(packed)  # [V, K], a view of the strips
        pairs, norms = [], []
        for start in range(0, strips * STRIP, _BUILD_ROWS):
            rows = weight[start : start + _BUILD_ROWS]
            if not bool(rows.abs().lt(1e38).all()):  # beyond bfloat16's largest finite value
                return None
            pairs.append(_bf16_pairs(rows))
            # Rounded up: the kernel's bound must not be short by float32's last bit.
            norms.append(rows.double().norm(dim=1).mul_(1 + 1e-6).float())
        return cls(packed, torch.cat(pairs), torch.cat(norms), kernels)

    @property
    def nbytes(self) -> int:
        """Memory of the screen beyond the head's own weights."""
        return sum(t.numel() * t.element_size() for t in (self.pairs, self.norms))

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """Row i's argmax of x @ W^T (x [M, K] float32), as packed_linear and max(dim).indices
        would give it; None when a row needs the full head."""
        x = x.contiguous()
        m = x.shape[0]
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"x must be float32 [M, {self.in_features}], got {x.dtype} {list(x.shape)}"
            )
        rows = -(-min(m, ROWS) // TILE_ROWS) * TILE_ROWS  # the kernel's AMX tiles take 16
        if self._scratch.numel() < rows * self.vocab_size:
            self._scratch = torch.empty(rows * self.vocab_size)
            self._x_pairs = torch.empty(rows * self.in_features // 2, dtype=torch.int32)
        out = torch.empty(m, dtype=torch.int64)
        for start in range(0, m, ROWS):
            block = x[start : start + ROWS]
            failed = self.kernels.greedy_head(
                block.data_ptr(), block.shape[0], self.in_features, self.pairs.data_ptr(),
                self.packed.data_ptr(), self.norms.data_ptr(), self.norm_max, self.vocab_size,
                MAX_STRIPS,
                self._scratch.data_ptr(), self._x_pairs.data_ptr(), out[start:].data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            if failed:
                return None
        return out

    def screened_logits(self, rows: int) -> torch.Tensor:
        """The bfloat16 screen's logits of the last block's first `rows` rows (for tests)."""
        return self._scratch[: rows * self.vocab_size].view(rows, self.vocab_size)


def _bf16_pairs(rows: torch.Tensor) -> torch.Tensor:
    """Rows [N, K] of W (N a multiple of 16) as [N / 16, K / 2, 16] int32: strip s, pair i,
    column j holds W[16 s + j, 2 i] (low half) and W[16 s + j, 2 i + 1] (high half) in
    bfloat16, rounded to nearest even."""
    n, k = rows.shape
    bf16 = rows.to(torch.bfloat16).view(n // STRIP, STRIP, k // 2, 2).transpose(1, 2)
    return bf16.contiguous().view(torch.int32).view(n // STRIP, k // 2, STRIP)
