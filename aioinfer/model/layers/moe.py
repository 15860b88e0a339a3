"""The sparse MLP of mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral).

A router scores every expert for each token; the token goes through its top-k experts (each a
SiLU-gated MLP) and their outputs are summed, weighted by the softmax of those scores. Each
layer's experts live in two stacked weights, named and laid out as transformers keeps them in
memory: `gate_up_proj` [E, 2I, H] (an expert's gate rows, then its up rows) and `down_proj`
[E, H, I]. Checkpoints store one tensor per expert and projection; `WeightSlot` tells the loader
where each of those lands.

Two ways to run the experts, with the same inputs and outputs (up to rounding: the GPU sums a
token's experts in the order the router ranked them, the CPU in expert order):
- `experts_by_loop` (the CPU): the tokens sorted by expert, one pair of GEMMs per expert that
  received any, accumulated as transformers accumulates them;
- the triton kernels of `kernels/fused_moe.py` (CUDA): all experts in two launches whose shapes
  do not depend on the routing, so a decode step with experts can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where a checkpoint tensor goes when its key is no parameter's name: `target` itself (the
    key was renamed), or, when `expert` is set, that expert's `rows` rows from `row` in a
    stacked weight (all of its rows when `rows` is None)."""

    target: str
    expert: int | None = None
    row: int = 0
    rows: int | None = None


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]): the top-k of the softmax over the
    experts, scaled to sum to 1 when `renormalize` (Mixtral always; Qwen by norm_topk_prob).
    The weights stay float32 for every model (transformers rounds Qwen's to the model dtype
    first, so in bfloat16 the outputs differ from its by that rounding)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_by_loop(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """sum over each token's experts e of weight_e * down_e(silu(gate_e x) * up_e x), [T, H].

    One GEMM pair per expert that any token chose; the host reads the per-expert counts, so this
    runs eagerly (the CPU path). Each token's sum accumulates in expert order, as in transformers.
    """
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    row_weights = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate, up = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, (y * row_weights[start : start + count, None]).to(x.dtype))
        start += count
    return out


class FusedExperts(nn.Module):
    """The experts of one layer: `forward(x, weights, ids)` -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from aioinfer.model.kernels.fused_moe import fused_experts

            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        return experts_by_loop(x, self.gate_up_proj, self.down_proj, weights, ids)

    def extra_repr(self) -> str:
        experts, rows, hidden = self.gate_up_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={rows // 2}"


class SparseMoeBlock(nn.Module):
    """Router (`gate`), experts, and optionally a shared expert that every token takes, scaled
    by a sigmoid gate (Qwen2-MoE). Parameter names follow transformers'."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for x [T, H], plus residual when given (as `LlamaMLP`)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if residual is None else residual + out
