"""AMX linears (cpu_kernels.c, "AMX linears"): the linears of coded weights over steps of 15 or
more rows, on the tile unit, as accurate as float32 against a float64 reference; an engine that
runs them gives the FMA engine's tokens, with logprobs equal to float32's rounding.

Skipped where the CPU, the kernels' build or the OS gives no AMX."""

from __future__ import annotations

import pytest
import torch

from aioinfer import LLM, SamplingParams
from aioinfer.model.kernels import cpu_native
from aioinfer.model.kernels.packed_weights import CodedWeight, code_weight
from aioinfer.model.layers.native_cpu import PackedLinear
from tests.model.test_coded_weights import _quantized_tiny_model, ggml_round_trip, random_blocks
from tests.model.tiny_models import make_hf_model
from tests.tokenizer_fixtures import make_tokenizer

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
def test_rows_beyond_amx_range_keep_the_fma_path(kernels: cpu_native.NativeKernels, row) -> None:
    """Infinities would meet codes of 0 (NaN), a run's sums of huge values overflow before
    their scale, and the tile unit flushes the subnormal parts of a tiny row: with such a row
    the whole linear runs on the FMA path, bit for bit."""
    weight, coded = coded_weight("Q4_1", 48, 64, seed=3)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    if row == "tiny":
        x[7] *= 1e-37
    else:
        x[7, 37] = {"inf": float("inf"), "nan": float("nan"), "huge": 3e38}[row]
    on_amx = CodedWeight(coded.codes, coded.scales, amx=True)
    got, fma = kernels.packed_linear(x, on_amx, None), kernels.packed_linear(x, coded, None)
    assert torch.equal(got.view(torch.int32), fma.view(torch.int32))
    x[7] = 0.0  # a row of zeros is exact on AMX: the linear runs there
    got, fma = kernels.packed_linear(x, on_amx, None), kernels.packed_linear(x, coded, None)
    assert not torch.equal(got, fma)
    error, scale = error_and_scale(got, x, weight, torch.zeros(48))
    assert bool((error <= TOLERANCE * scale).all())


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
    """Prompt steps of 52 tokens run every linear of a layer on AMX (q, k and v from one split
    of x; o and down added to the residual; gate and up as one gated pass); the decode steps of
    6 rows stay on the FMA path. The coded linears keep no float32 strips then (the plan's
    count: test_coded_weights.py, for a GGUF); tokens equal the FMA engine's, logprobs close."""
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
        assert all(m.amx for m in layers[1].modules() if isinstance(m, PackedLinear))

    fma = engine_outputs(tmp_path, False, lambda model: None)
    assert_same_tokens_close_logprobs(fma, engine_outputs(tmp_path, True, check))
