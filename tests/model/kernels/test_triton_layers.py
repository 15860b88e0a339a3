"""The triton RMSNorm, SiLU-and-mul and rotary kernels against the torch modules they replace.

Without CUDA they run under TRITON_INTERPRET=1 (set by tests/conftest.py) in float32: the
interpreter does no bfloat16 arithmetic. With CUDA the same checks run natively, in bfloat16 too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from aioinfer.model.kernels import norm_act, rotary
from aioinfer.model.layers.activation import SiluAndMul
from aioinfer.model.layers.norm import RMSNorm
from aioinfer.model.layers.rotary import ApplyRotary, RopeConfig, RotaryEmbedding
from aioinfer.model.layers.triton_layers import (
    TritonApplyRotary,
    TritonRMSNorm,
    TritonSiluAndMul,
    kernel_mismatch,
    use_triton_kernels,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and type(norm_act._rms_norm_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "the triton kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this module on its own",
        allow_module_level=True,
    )
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bfloat16: the kernel and torch may sum the squares in another order, which can move a
    # result across a rounding boundary (one bfloat16 ulp is 2^-8 relative).
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 1536), (3, 4, 128), (2, 100)])
def test_rms_norm_matches_the_torch_module(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen, device=DEVICE))
    x = (torch.randn(shape, generator=gen, device=DEVICE) * 3).to(dtype)
    got = TritonRMSNorm(norm)(x)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, norm(x), **tolerance(dtype))


def test_rms_norm_reads_strided_rows() -> None:
    """A slice of a wider tensor (q out of a fused qkv, say): rows of unit stride, spaced wider."""
    norm = RMSNorm(64).to(DEVICE)
    wide = torch.randn(6, 3 * 64, device=DEVICE)
    x = wide[:, 64:128]
    torch.testing.assert_close(TritonRMSNorm(norm)(x), norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1023, 1024, 5 * 1536 + 7])
def test_silu_and_mul_matches_the_torch_module(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    gate, up = (torch.randn(2, n, generator=gen, device=DEVICE) * 4).to(dtype)
    expected = SiluAndMul()(gate.clone(), up)
    got = TritonSiluAndMul()(gate, up)
    assert got.data_ptr() == gate.data_ptr()  # in place, as the torch module
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_silu_and_mul_reads_the_halves_of_a_merged_gate_up_output() -> None:
    """gate and up as the two halves of one [T, 2I] GEMM output: rows spaced 2I apart; the
    result lands in the gate half, the up half untouched."""
    gate_up = torch.randn(5, 2 * 1100, device=DEVICE) * 4
    gate, up = gate_up.split(1100, dim=-1)
    expected = SiluAndMul()(gate.clone(), up.clone())
    up_before = up.clone()
    got = TritonSiluAndMul()(gate, up)
    assert got.data_ptr() == gate.data_ptr()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(up, up_before, atol=0, rtol=0)

    # Each read with its own row spacing.
    gate = torch.randn(5, 1100, device=DEVICE)
    up = torch.randn(5, 3 * 1100, device=DEVICE)[:, 1100:2200]
    expected = SiluAndMul()(gate.clone(), up)
    torch.testing.assert_close(TritonSiluAndMul()(gate, up), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim"), [(1, 9, 64), (7, 3, 64), (5, 12, 128), (3, 5, 96)]
)
def test_rotary_matches_the_torch_module(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int
) -> None:
    """Real cos/sin of scattered positions (a decode batch), head counts and a head_dim that are
    not powers of two (masked lanes)."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens * heads + head_dim)
    rope = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0, rope_type="default", params=()))
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE)
    cos, sin = rope(positions, dtype)
    x = (torch.randn(tokens, heads, head_dim, generator=gen, device=DEVICE) * 2).to(dtype)
    got = TritonApplyRotary()(x, cos, sin)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, ApplyRotary()(x, cos, sin), **tolerance(dtype))


def test_rotary_reads_strided_heads_and_falls_back_on_strided_dims() -> None:
    """q as a view of a fused qkv output: heads of unit-stride dims, tokens spaced wider; a
    transposed head_dim is rotated by torch instead."""
    qkv = torch.randn(4, 5 * 64, device=DEVICE)
    q = qkv[:, : 3 * 64].view(4, 3, 64)
    cos, sin = torch.randn(2, 4, 32, device=DEVICE)
    expected = ApplyRotary()(q, cos, sin)
    torch.testing.assert_close(rotary.apply_rotary(q, cos, sin), expected, atol=1e-5, rtol=1e-5)
    x = torch.randn(4, 64, 3, device=DEVICE).transpose(1, 2)
    torch.testing.assert_close(
        TritonApplyRotary()(x, cos, sin), ApplyRotary()(x, cos, sin), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="cos and sin must have shape"):
        rotary.apply_rotary(q, cos[:, :16], sin[:, :16])


def test_swap_checks_each_kernel_and_keeps_state_dicts() -> None:
    model = torch.nn.ModuleDict(
        {"norm": RMSNorm(64), "act": SiluAndMul(), "rotary": ApplyRotary()}
    ).to(DEVICE)
    before = model.state_dict()
    assert use_triton_kernels(model, torch.float32, DEVICE) == 3
    assert isinstance(model["norm"], TritonRMSNorm) and isinstance(model["act"], TritonSiluAndMul)
    assert isinstance(model["rotary"], TritonApplyRotary)
    assert model.state_dict().keys() == before.keys()


def test_a_kernel_that_disagrees_or_fails_is_not_used() -> None:
    norm = RMSNorm(32).to(DEVICE)
    x = torch.randn(3, 32, device=DEVICE)
    assert kernel_mismatch(norm, TritonRMSNorm(norm), x) is None

    class Off(TritonRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 1.01

    class Broken(TritonRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no kernel image for this device")

    assert "differ" in (kernel_mismatch(norm, Off(norm), x) or "")
    assert "no kernel image" in (kernel_mismatch(norm, Broken(norm), x) or "")
