"""The mixture-of-experts triton kernels against the expert-by-expert torch path.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set here, before any kernel module is
imported); with CUDA the same checks run natively. Every case draws fresh random inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from aioinfer.model.kernels.fused_moe import (
    _expert_gemm_kernel,
    align_by_expert,
    block_rows,
    fused_experts,
)
from aioinfer.model.layers.moe import experts_by_loop, route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and type(_expert_gemm_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "the triton kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this module on its own",
        allow_module_level=True,
    )


def random_routing(
    gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int, skew: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skew:  # most tokens pick the same few experts; some experts get none
        logits[:, : num_experts // 2] += 4.0
    return route(logits.to(DEVICE), top_k, renormalize=True)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [(1, 4, 1, 4), (5, 8, 2, 4), (37, 8, 3, 16), (64, 16, 2, 16)],
)
def test_alignment_gives_each_tile_one_expert(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    _, ids = random_routing(gen, num_tokens, num_experts, top_k, skew=True)
    sorted_rows, tile_experts, padded_len = align_by_expert(ids, num_experts, block_m)
    num_rows = num_tokens * top_k
    rows = sorted_rows.cpu().tolist()
    flat = ids.reshape(-1).cpu().tolist()
    length = int(padded_len.item())
    # Sizes are the worst case for any routing, so a CUDA graph can replay other routings.
    assert sorted_rows.numel() == num_rows + num_experts * (block_m - 1)
    assert tile_experts.numel() == -(-sorted_rows.numel() // block_m)
    assert length % block_m == 0
    assert sorted(r for r in rows if r < num_rows) == list(range(num_rows))  # each row once
    assert all(r == num_rows for r in rows[length:])  # nothing past the padded length
    experts = tile_experts.cpu().tolist()
    for tile in range(length // block_m):
        members = [r for r in rows[tile * block_m : (tile + 1) * block_m] if r < num_rows]
        assert members, "a tile inside the padded length holds at least one row"
        assert {flat[r] for r in members} == {experts[tile]}
        assert members == sorted(members)  # stable: a token's rows keep their order
    assert all(e == num_experts for e in experts[length // block_m :])


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "skew"),
    [
        (1, 4, 1, 32, 48, False),
        (7, 8, 2, 64, 40, False),
        (33, 8, 2, 48, 64, True),
        (20, 16, 4, 32, 24, True),
        (0, 4, 2, 32, 48, False),  # an empty batch
        (9, 64, 8, 33, 17, True),  # sizes off the tiles; most experts get no row
    ],
)
def test_fused_experts_match_the_loop(num_tokens, num_experts, top_k, hidden, inter, skew):
    gen = torch.Generator().manual_seed(1000 + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(DEVICE)
    weights, ids = random_routing(gen, num_tokens, num_experts, top_k, skew)
    expected = experts_by_loop(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    got = fused_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_large_batches_use_large_tiles():
    assert block_rows(16) == 16
    assert block_rows(4096) == 64
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_experts, top_k, hidden, inter = 600, 4, 2, 16, 16  # 1200 rows: 64-row tiles
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(DEVICE)
    weights, ids = random_routing(gen, num_tokens, num_experts, top_k, skew=True)
    expected = experts_by_loop(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    torch.testing.assert_close(
        fused_experts(x, gate_up, down, weights, ids).cpu(), expected, atol=1e-5, rtol=1e-5
    )


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 runs compiled only")
def test_fused_experts_bfloat16():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 128, generator=gen)
    gate_up = torch.randn(8, 256, 128, generator=gen) * 0.05
    down = torch.randn(8, 128, 128, generator=gen) * 0.05
    weights, ids = random_routing(gen, 40, 8, 2)
    expected = experts_by_loop(x, gate_up, down, weights.cpu(), ids.cpu())
    bf16 = [t.to(DEVICE, torch.bfloat16) for t in (x, gate_up, down)]
    got = fused_experts(*bf16, weights, ids).float().cpu()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
