"""AMX linears (model/cpu/kernels.c, "AMX linears"): the linears of coded weights over steps of 15
or more rows, on the tile unit, as accurate as float32 against a float64 reference; an engine that
runs them gives the FMA engine's tokens, with logprobs equal to float32's rounding.

Skipped where the CPU, the kernels' build or the OS gives no AMX."""

from __future__ import annotations

import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.cpu.layers import PackedLinear
from aioinfer.model.cpu.packed_weights import CodedWeight, code_weight
from tests.model.cpu.test_coded_weights import _quantized_tiny_model, ggml_round_trip, random_blocks
from tests.support.tiny_models import make_hf_model
from tests.support.tokenizers import make_tokenizer

# Error allowed per output, as a share of sum_k |x_k w_k| + |bias|: a few float32 roundings
# (each run's sums hold 96 exact products). x in two bfloat16 parts would be off by about
# 2^-17 of it, a lost scale or offset by far more.
TOLERANCE = 2.0**-21


@pytest.fixture(scope="module")
def kernels() -> cpu_native.NativeKernels:
    built = cpu_native.load()
    if built is None:
        pytest.skip(cpu_native.unavailable_reason())
    if not built.has_amx:
        pytest.skip("no AMX on this CPU, in this build or from this OS")
    return built


def coded_weight(qtype: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, CodedWeight]:
    gen = torch.Generator().manual_seed(seed)
    if qtype.endswith("_K"):
        weight = random_blocks(n, k, qtype, seed=seed)
    else:
        weight = ggml_round_trip(torch.randn(n, k, generator=gen) * 0.05, qtype)
    coded = code_weight(weight, cpu_native.load().code_runs)  # type: ignore[union-attr]
    assert coded is not None
    return weight, coded


def error_and_scale(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """|got - exact| and sum_k |x_k w_k| + |bias|, per output."""
    xd, wd, bd = x.double(), weight.double(), bias.double()
    return (got.double() - (xd @ wd.T + bd)).abs(), xd.abs() @ wd.abs().T + bd.abs()


def relative_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    error, scale = error_and_scale(got, x, weight, bias)
    return error / scale


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("m", [15, 16, 17, 32, 47, 64, 300])
def test_amx_linears_are_as_accurate_as_float32(
    kernels: cpu_native.NativeKernels, qtype: str, m: int
) -> None:
    """Rows in single and paired tiles, padded ones, and 3 strips (a half-wide last tile); x
    spread over 2^-20 .. 2^20, so that every bfloat16 part of it counts."""
    n, k = 48, 512
    weight, coded = coded_weight(qtype, n, k, seed=m)
    on_amx = CodedWeight(coded.codes, coded.scales, amx=True)
    gen = torch.Generator().manual_seed(100 + m)
    spread = 2.0 ** torch.randint(-20, 21, (m, k), generator=gen).float()
    x = torch.randn(m, k, generator=gen) * spread
    bias = torch.randn(n, generator=gen)
    got = kernels.packed_linear(x, on_amx, bias)
    assert float(relative_error(got, x, weight, bias).max()) <= TOLERANCE
    # The FMA path, for scale: each output one chain of k FMAs
    fma = relative_error(kernels.packed_linear(x, coded, bias), x, weight, bias)
    assert float(relative_error(got, x, weight, bias).mean()) <= 2 * float(fma.mean())


@pytest.mark.parametrize(
    "row", ["inf", "nan", "huge", "tiny"], ids=["inf", "nan", "beyond 2^100", "below 2^-100"]
)
@pytest.mark.parametrize("rows", [20, 130], ids=["codes", "parts"])
def test_rows_beyond_amx_range_keep_the_fma_path(
    kernels: cpu_native.NativeKernels, row, rows: int
) -> None:
    """Infinities would meet codes of 0 (NaN), a run's sums of huge values overflow before
    their scale, and the tile unit flushes the subnormal parts of a tiny row: with such a row
    the whole linear runs on the FMA path, bit for bit."""
    weight, coded = coded_weight("Q4_1", 48, 64, seed=3)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(4))
    if row == "tiny":
        x[7] *= 1e-37
    else:
        x[7, 37] = {"inf": float("inf"), "nan": float("nan"), "huge": 3e38}[row]
    on_amx = CodedWeight(coded.codes, coded.scales, amx=True)
    if rows >= 128:
        on_amx = with_parts(kernels, coded)
    got, fma = kernels.packed_linear(x, on_amx, None), kernels.packed_linear(x, coded, None)
    assert torch.equal(got.view(torch.int32), fma.view(torch.int32))
    x[7] = 0.0  # a row of zeros is exact on AMX: the linear runs there
    got, fma = kernels.packed_linear(x, on_amx, None), kernels.packed_linear(x, coded, None)
    assert not torch.equal(got, fma)
    error, scale = error_and_scale(got, x, weight, torch.zeros(48))
    assert bool((error <= TOLERANCE * scale).all())


# GGUF types whose codes times scales split into two bfloat16 parts (packed_weights.py).
PARTS_QUANTS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Error allowed from weight parts, as a share of sum_k |x_k w_k| + |bias|: each output sums
# its whole K in one float32 accumulator, five products a multiply-add, which puts it near an
# FMA chain's error (measured too, below) rather than the per-run sums' above.
PARTS_TOLERANCE = 2.0**-19


def with_parts(kernels: cpu_native.NativeKernels, coded: CodedWeight) -> CodedWeight:
    parts = kernels.weight_parts(coded.codes, coded.scales)
    assert parts is not None
    return CodedWeight(coded.codes, coded.scales, amx=True, parts=parts)


def parts_values(parts: torch.Tensor) -> torch.Tensor:
    """hi + lo of each weight part, [N, runs * 32], undoing the tile layout."""
    values = (parts.to(torch.int32) << 16).view(torch.float32)  # [S, runs, part, pair, col, k]
    summed = values[:, :, 0] + values[:, :, 1]
    strips = parts.shape[0]
    return summed.permute(0, 3, 1, 2, 4).reshape(strips * 16, -1)


@pytest.mark.parametrize("qtype", PARTS_QUANTS)
def test_weight_parts_rebuild_each_code_times_scale_then_the_offsets(
    kernels: cpu_native.NativeKernels, qtype: str
) -> None:
    n, k = 48, 1088  # 34 runs: their offsets take two runs of parts
    weight, coded = coded_weight(qtype, n, k, seed=7)
    parts = kernels.weight_parts(coded.codes, coded.scales)
    assert parts is not None and parts.shape[1] == 34 + 2
    values = parts_values(parts)
    scale = coded.scales[:, :, 0].repeat_interleave(32, dim=1).transpose(1, 2).reshape(n, k)
    offset = coded.scales[:, :, 1].transpose(1, 2).reshape(n, k // 32)
    codes = coded.codes.transpose(1, 2).reshape(n, k).to(torch.float32)
    assert torch.equal(values[:, :k], codes * scale)
    assert torch.equal(values[:, k : k + 34], offset)
    assert not values[:, k + 34 :].any()
    assert torch.equal(values[:, :k] + offset.repeat_interleave(32, dim=1), weight)


def test_weight_parts_are_refused_where_two_bfloat16s_do_not_hold_a_weight(
    kernels: cpu_native.NativeKernels,
) -> None:
    """Q8_0's codes of 7 bits and a sign times a float16 need up to 18 bits; weights beyond
    2^12 could overflow a sum with x up to 2^100; subnormal parts the tile unit flushes."""
    _, q8 = coded_weight("Q8_0", 32, 64, seed=1)
    assert kernels.weight_parts(q8.codes, q8.scales) is None
    _, q4 = coded_weight("Q4_1", 32, 64, seed=1)
    assert kernels.weight_parts(q4.codes, q4.scales) is not None
    for value in (2.0**13, 2.0**-110):
        scales = q4.scales.clone()
        scales[1, 0, 1, 3] = value  # one offset
        assert kernels.weight_parts(q4.codes, scales) is None


@pytest.mark.parametrize("qtype", PARTS_QUANTS)
@pytest.mark.parametrize("m", [128, 129, 300])
def test_linears_from_weight_parts_are_as_accurate_as_float32(
    kernels: cpu_native.NativeKernels, qtype: str, m: int
) -> None:
    """Steps of 128 or more rows read the parts: groups of 4 row tiles and a last partial one,
    3 strips, x spread over 2^-20 .. 2^20."""
    n, k = 48, 512
    weight, coded = coded_weight(qtype, n, k, seed=m)
    gen = torch.Generator().manual_seed(200 + m)
    spread = 2.0 ** torch.randint(-20, 21, (m, k), generator=gen).float()
    x = torch.randn(m, k, generator=gen) * spread
    bias = torch.randn(n, generator=gen)
    got = kernels.packed_linear(x, with_parts(kernels, coded), bias)
    runs = kernels.packed_linear(x, CodedWeight(coded.codes, coded.scales, amx=True), bias)
    assert not torch.equal(got, runs)  # another path: the parts, not the per-run sums
    error = relative_error(got, x, weight, bias)
    assert float(error.max()) <= PARTS_TOLERANCE
    fma = relative_error(kernels.packed_linear(x, coded, bias), x, weight, bias)
    assert float(error.mean()) <= 2 * float(fma.mean())


def engine_outputs(path, amx: bool, check) -> list:
    """Greedy outputs with logprobs of prompts of 4 and 52 tokens through an engine."""
    prompts = [[7 + i, 19, 300 + i, 42] * (1 + 12 * (i % 2)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    with LLM(
        str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=128, cpu_amx=amx
    ) as llm:
        check(llm.engine.gpu.runner.model)
        return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def assert_same_tokens_close_logprobs(fma_outputs: list, amx_outputs: list) -> None:
    """The same tokens; logprobs within 1e-3: float32 rounding in another order, carried
    through 16 steps of a random model (4e-6 here, once 1.5e-4 in a full test run)."""
    for fma, amx in zip(fma_outputs, amx_outputs, strict=True):
        assert amx.token_ids == fma.token_ids
        for want, got in zip(fma.logprobs, amx.logprobs, strict=True):
            assert want.keys() == got.keys()
            for token, logprob in want.items():
                assert got[token].logprob == pytest.approx(logprob.logprob, abs=1e-3)


def test_an_engine_with_amx_linears_gives_the_fma_engines_tokens(
    kernels: cpu_native.NativeKernels, tmp_path
) -> None:
    """The prompt step of 168 tokens runs every linear of a layer on AMX (q, k and v from one
    split of x; o and down added to the residual; gate and up as one gated pass), from weight
    parts where the weight has them and from codes where not (Q8_0, and a gate whose up has
    none); the decode steps of 6 rows stay on the FMA path. The coded linears keep no float32
    strips then (the plan's count: test_coded_weights.py, for a GGUF); tokens equal the FMA
    engine's, logprobs close."""
    if kernels is not cpu_native.load():
        pytest.skip("the engine runs this machine's build")
    _quantized_tiny_model(tmp_path)
    outputs = {}
    for amx in (False, True):

        def check(model, amx=amx) -> None:
            linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
            coded = [m for m in linears if m.codes is not None]
            assert len(coded) == 12
            assert all(m.amx == amx and (m.packed is None) == amx for m in coded)
            with_parts = [m for m in coded if m.parts is not None]
            assert len(with_parts) == (10 if amx else 0)  # all but the 2 Q8_0s

        outputs[amx] = engine_outputs(tmp_path, amx, check)
    assert_same_tokens_close_logprobs(outputs[False], outputs[True])


def test_a_float_first_layer_before_amx_layers(kernels: cpu_native.NativeKernels, tmp_path) -> None:
    """Layer 0 holds trained floats, layer 1 codes: the step's scratch must hold the AMX
    linears' split of x though the first layer has none."""
    if kernels is not cpu_native.load():
        pytest.skip("the engine runs this machine's build")
    hf = make_hf_model("llama", seed=5, hidden_size=128, intermediate_size=192)
    with torch.no_grad():
        for module in hf.model.layers[1].modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(ggml_round_trip(module.weight, "Q4_1"))
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)

    def check(model) -> None:
        layers = model.model.layers
        assert all(m.codes is None for m in layers[0].modules() if isinstance(m, PackedLinear))
        linears = [m for m in layers[1].modules() if isinstance(m, PackedLinear)]
        assert all(m.amx and m.parts is not None for m in linears)

    fma = engine_outputs(tmp_path, False, lambda model: None)
    assert_same_tokens_close_logprobs(fma, engine_outputs(tmp_path, True, check))


@pytest.mark.parametrize("tokens", [40, 160], ids=["codes", "parts"])
def test_decoder_layers_on_amx_match_the_torch_modules(
    kernels: cpu_native.NativeKernels, tokens: int
) -> None:
    """A prompt step through the one-call layers on AMX, with attention and MLP biases (the
    gated pass adds both of its biases before silu(gate) * up; o and down add to the
    residual), from codes at 40 rows and from weight parts at 160: torch's hidden states."""
    from aioinfer.model.cpu.attention import NativeAttentionBackend
    from aioinfer.model.cpu.layers import use_native_kernels
    from aioinfer.model.forward_context import forward_context
    from aioinfer.model.layers.attention import AttentionMetadata
    from aioinfer.model.layers.torch_attention import TorchAttentionBackend
    from tests.model.cpu.test_kernels import _our_model_of

    hf = make_hf_model(
        "llama", seed=8, hidden_size=128, intermediate_size=192, attention_bias=True,
        mlp_bias=True,
    )  # fmt: skip
    with torch.no_grad():
        for module in hf.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(ggml_round_trip(module.weight, "Q4_1"))
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.5)
    reference, native = _our_model_of(hf), _our_model_of(hf)
    use_native_kernels(native, kernels, amx=True)
    linears = [m for m in native.model.layers.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.amx and m.parts is not None for m in linears)
    block_size = 16
    table = list(range(1, 1 + -(-tokens // block_size)))
    metadata = AttentionMetadata.build([tokens], [0], [table], block_size)
    shape = native.kv_cache_shape(len(table) + 1, block_size)
    caches = [torch.zeros(shape) for _ in range(native.config.num_layers)]
    ref_caches = [c.clone() for c in caches]
    ids = torch.randint(0, native.config.vocab_size, (tokens,), generator=torch.Generator())
    with torch.no_grad():
        with forward_context(metadata, caches, NativeAttentionBackend(kernels)):
            got = native(ids, metadata.positions)
        with forward_context(metadata, ref_caches, TorchAttentionBackend()):
            expected = reference(ids, metadata.positions)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
