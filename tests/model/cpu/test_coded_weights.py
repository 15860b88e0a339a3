"""Byte-coded linear weights (packed_weights.py): found exactly where GGUF's simple quantizations
made the weights, and run by the native kernels with the float32 strips' results, bit for bit.

Skipped, with the reason, where the native kernels cannot build."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from torch import nn

from aioinfer import LLM, SamplingParams
from aioinfer.bench import latency
from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.cpu import packed_weights
from aioinfer.model.cpu.layers import PackedLinear, use_native_kernels
from aioinfer.model.cpu.packed_weights import CodedWeight, code_weight
from tests.support.tiny_models import make_hf_model
from tests.support.tokenizers import make_tokenizer

SIMPLE_QUANTS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def ggml_round_trip(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """`weight` quantized and dequantized by gguf-py (ggml's reference quantizers), float32."""
    kind = GGMLQuantizationType[qtype]
    blocks = quantize(weight.numpy().astype(np.float32), kind)
    return torch.from_numpy(dequantize(blocks, kind).astype(np.float32)).reshape(weight.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("qtype", SIMPLE_QUANTS)
def test_ggml_blocks_are_coded_exactly(kernels: cpu_native.NativeKernels, qtype: str) -> None:
    gen = torch.Generator().manual_seed(len(qtype) + ord(qtype[1]))
    weight = torch.randn(48, 160, generator=gen) * torch.logspace(-3, 1, 48).unsqueeze(1)
    weight[3, 32:64] = 0.0  # a run of zeros: scale 0
    weight[5, 64:96] = 0.25  # a run of one value
    weight = ggml_round_trip(weight, qtype)
    coded = code_weight(weight, kernels.code_runs)
    assert coded is not None
    assert coded.codes.dtype == torch.int8 and coded.codes.shape == (3, 160, 16)
    assert coded.scales.shape == (3, 5, 2, 16)
    assert coded.nbytes * 4 == weight.nbytes * 1.25  # 1.25 bytes a weight instead of 4
    assert same_bits(coded.decode(), weight)


def random_blocks(
    rows: int, cols: int, qtype: str, seed: int, d_max: float = 0.0045
) -> torch.Tensor:
    """A [rows, cols] weight of random GGUF blocks of `qtype`, as gguf-py reads them back:
    Q4_1 and Q5_1 (float16 d and m, then the codes), Q4_K and Q5_K (super-blocks of 256: float16
    d and dmin, packed 6-bit sub-block scales and mins, the codes) or Q6_K (its float16 d last).
    Random codes often leave a run's extremes off codes 0 and 15 (or 31), as least-squares and
    importance-matrix quantizers sometimes do."""
    kind = GGMLQuantizationType[qtype]
    blocks = random_block_bytes(rows, cols, kind, seed, d_max)
    return torch.from_numpy(dequantize(blocks, kind).astype(np.float32))


def random_block_bytes(
    rows: int, cols: int, kind: GGMLQuantizationType, seed: int, d_max: float
) -> np.ndarray:
    """The blocks of random_blocks, as a GGUF file holds them: uint8 [rows, bytes a row]."""
    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    count = rows * cols // block_weights
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    if kind != GGMLQuantizationType.Q6_K:  # d and dmin (or m) lead the block
        d = (rng.random((count, 2)) * d_max * 0.9 + d_max * 0.1).astype(np.float16)
        blocks[:, :4] = d.view(np.uint8)
    else:  # Q6_K: d ends it
        d = (rng.random((count, 1)) * d_max * 0.9 + d_max * 0.1).astype(np.float16)
        blocks[:, -2:] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_1", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("m", [1, 16, 40])
def test_blocks_off_the_extreme_codes_are_coded_exactly(
    kernels: cpu_native.NativeKernels, qtype: str, m: int
) -> None:
    """Runs of codes under a float16 scale (Q4_1, Q5_1) or one of 17 significant bits (Q4_K's
    and Q5_K's d * sc, sub-blocks of 32), found whether or not a run's highest weight has the
    top code; the linears read them to the strips' results, bit for bit."""
    weight = random_blocks(48, 512, qtype, seed=m)
    coded = code_weight(weight, kernels.code_runs)
    assert coded is not None
    assert same_bits(coded.decode(), weight)
    runs = coded.codes.transpose(1, 2).reshape(48, -1, 32).int()
    top = 15 if qtype.startswith("Q4") else 31
    assert runs.min() == 0 and runs.max() == top
    assert (runs.amax(-1) < top).any()  # runs whose span is not top steps
    scales = coded.scales[:, :, 0].flatten()
    needs_17_bits = (scales.view(torch.int32) & 0xFF != 0).any()
    assert needs_17_bits == qtype.endswith("_K")
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    expected = kernels.packed_linear(x, packed_weights.pack_weight(weight), None)
    assert same_bits(kernels.packed_linear(x, coded, None), expected)


def test_an_engine_reads_a_k_quant_ggufs_linears_as_codes(
    kernels: cpu_native.NativeKernels, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF whose attention and MLP linears are Q4_K and Q5_K but for one Q6_K down
    projection: those linears hold codes (plan predicts the memory they take), and the engine
    gives the float32 engine's tokens and logprobs, bit for bit (on the FMA path: AMX linears
    sum in another order, see test_amx_linears.py)."""
    import gguf

    from aioinfer.cli.plan import build_plan_configs, make_plan
    from tests.model.loader.test_loader import write_gguf

    if kernels is not cpu_native.load():
        pytest.skip("the engine runs this machine's build")
    hf = make_hf_model("llama", seed=7, hidden_size=256, intermediate_size=512)
    reference_quantize = gguf.quantize

    def quantize(array: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
        if kind.name.endswith("_K"):  # gguf-py writes no K-quants: random blocks instead
            return random_block_bytes(*array.shape, kind, seed=array.size, d_max=2e-4)
        return reference_quantize(array, kind)

    def kind(name: str) -> GGMLQuantizationType | None:
        if name == "model.layers.1.mlp.down_proj.weight":
            return GGMLQuantizationType.Q6_K
        if name.startswith("model.layers."):
            return GGMLQuantizationType.Q5_K if "down" in name else GGMLQuantizationType.Q4_K
        return None

    monkeypatch.setattr(gguf, "quantize", quantize)
    path = write_gguf(hf, tmp_path / "KQuants.gguf", "llama", qtype=kind)
    make_tokenizer().save_pretrained(tmp_path / "tok")
    planned = make_plan(
        *build_plan_configs(
            {"model": str(path), "device": "cpu", "cpu_weight_format": "auto", "cpu_amx": False}
        )
    ).weights_bytes
    prompts = [[7 + i, 19, 300 + i, 42] * (1 + 6 * (i % 2)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outputs = {}
    for fmt in ("float32", "auto"):
        with LLM(
            str(path), tokenizer=str(tmp_path / "tok"), dtype="float32", kv_cache_memory=0.01,
            max_model_len=64, cpu_weight_format=fmt, cpu_amx=False,
        ) as llm:  # fmt: skip
            model = llm.engine.gpu.runner.model
            linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
            coded = [m for m in linears if m.codes is not None]
            assert len(coded) == (0 if fmt == "float32" else 13)  # 14 linears less one Q6_K
            if fmt == "auto":
                assert model.model.layers[1].mlp.down_proj.codes is None
                held = sum(p.numel() * p.element_size() for p in model.parameters())
                assert planned == held
            outputs[fmt] = [
                (c.token_ids, c.logprobs)
                for out in llm.generate(prompts, params, use_tqdm=False)
                for c in out.outputs
            ]
    assert outputs["auto"] == outputs["float32"]


def test_k_quants_with_sub_blocks_of_16_stay_float(kernels: cpu_native.NativeKernels) -> None:
    """Q6_K scales each 16 weights on its own: a run of 32 has two scales, no codes."""
    weight = random_blocks(16, 256, "Q6_K", seed=1)
    assert torch.isfinite(weight).all()
    assert code_weight(weight, kernels.code_runs) is None


def test_other_weights_stay_float(kernels: cpu_native.NativeKernels) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 64, generator=gen)
    q4 = ggml_round_trip(weight, "Q4_1")
    assert code_weight(q4, kernels.code_runs) is not None
    nudged = q4.clone()
    nudged[20, 7] = torch.nextafter(
        nudged[20, 7], torch.tensor(1e9)
    )  # one ulp off, past the sample
    with_nan = q4.clone()
    with_nan[31, 63] = float("nan")
    for other in (
        weight,  # trained float32
        weight.bfloat16().float(),  # bfloat16 values: not runs of codes
        nudged,
        with_nan,
        q4[:, :48],  # K not a multiple of 32
        q4[:24],  # N not a multiple of 16
        q4.double(),
    ):
        assert code_weight(other, kernels.code_runs) is None
    assert code_weight(q4[:, :32].contiguous(), kernels.code_runs) is not None


def test_zero_weights_keep_their_sign(kernels: cpu_native.NativeKernels) -> None:
    """Q4_0's d * (q - 8) is -0.0 where d < 0 and q = 8: the offset -0.0 keeps it so (an
    offset of +0.0, or a code of -0.0, would make it +0.0); a run of -0.0 alone too."""
    gen = torch.Generator().manual_seed(4)
    weight = ggml_round_trip(torch.randn(16, 96, generator=gen), "Q4_0")
    weight[9, 32:64] = -0.0
    negative_zeros = weight.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)
    assert negative_zeros.sum() > 32
    coded = code_weight(weight, kernels.code_runs)
    assert coded is not None
    assert same_bits(coded.decode(), weight)
    weight[9, 40] = 0.0  # +0.0 among the -0.0: a run no candidate rebuilds
    assert code_weight(weight, kernels.code_runs) is None


@pytest.mark.parametrize(
    ("m", "n", "k"),
    # Rows around the micro-tile (14 with AVX-512, 6 with AVX2: codes or strips when a weight
    # has both), the 15- and 16-row transposed tiles (AVX-512), DECODE_IN_REGISTERS_ROWS (28,
    # 12: registers or a panel with codes alone), odd and even strip counts, several row
    # blocks (85 rows each at K = 1536).
    [(1, 16, 32), (2, 48, 96), (6, 32, 576), (13, 96, 64), (14, 16, 1536), (15, 48, 32),
     (16, 80, 1536), (17, 32, 64), (28, 64, 576), (29, 80, 96), (64, 192, 576),
     (200, 48, 1536)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_coded_linears_give_the_float_strips_results_bit_for_bit(
    kernels: cpu_native.NativeKernels, m: int, n: int, k: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = ggml_round_trip(torch.randn(n, k, generator=gen) * 0.1, "Q4_1")
    coded = code_weight(weight, kernels.code_runs)
    assert coded is not None
    strips = packed_weights.pack_weight(weight)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    expected = kernels.packed_linear(x, strips, b)
    torch.testing.assert_close(
        expected, x @ weight.T + (0 if b is None else b), rtol=1e-4, atol=1e-4
    )
    both = CodedWeight(coded.codes, coded.scales, strips)
    assert same_bits(kernels.packed_linear(x, coded, b), expected)
    assert same_bits(kernels.packed_linear(x, both, b), expected)


def test_coded_weights_are_checked_before_the_kernel_reads_them(
    kernels: cpu_native.NativeKernels,
) -> None:
    weight = ggml_round_trip(torch.randn(32, 64), "Q8_0")
    coded = code_weight(weight, kernels.code_runs)
    assert coded is not None
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x must have 64 columns"):
        kernels.packed_linear(torch.randn(2, 96), coded, None)
    with pytest.raises(ValueError, match="scales"):
        kernels.packed_linear(x, CodedWeight(coded.codes, coded.scales[:, :1].contiguous()), None)
    with pytest.raises(ValueError, match="int8"):
        kernels.packed_linear(x, CodedWeight(coded.codes.int(), coded.scales), None)
    wrong_strips = packed_weights.pack_weight(torch.randn(32, 96))
    with pytest.raises(ValueError, match="differ"):
        kernels.packed_linear(x, CodedWeight(coded.codes, coded.scales, wrong_strips), None)


@pytest.mark.parametrize("tokens", [1, 5, 16, 40, 300])
def test_decoder_layers_with_coded_weights_give_the_float_results_bit_for_bit(
    kernels: cpu_native.NativeKernels, tokens: int
) -> None:
    """The one-call decoder layer, gated MLP included, with every linear coded (alone or
    beside its strips) against the same layer from strips, in each build: a prompt step of
    `tokens` rows, below and above the rows that decode in registers."""
    from tests.model.cpu.test_kernels import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, small_layer_tensors

    gen = torch.Generator().manual_seed(tokens)
    tensors = small_layer_tensors(gen)
    linears = ("q", "k", "v", "o", "gate", "up", "down")
    kinds = iter(SIMPLE_QUANTS * 2)
    for name in linears:
        weight = ggml_round_trip(packed_weights.unpack_weight(tensors[name]), next(kinds))
        tensors[name] = packed_weights.pack_weight(weight)
    coded = {name: code_weight(packed_weights.unpack_weight(tensors[name]), kernels.code_runs)
             for name in linears}  # fmt: skip
    assert all(c is not None for c in coded.values())
    both = {name: CodedWeight(c.codes, c.scales, tensors[name]) for name, c in coded.items()}
    block_size = 8
    x = torch.randn(tokens, HIDDEN, generator=gen)
    cos, sin = torch.rand(2, tokens, HEAD_DIM // 2, generator=gen)
    slots = torch.arange(block_size, block_size + tokens)
    tables = torch.arange(1, tokens // block_size + 2, dtype=torch.int32)[None]
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    results = []
    for form in ({}, coded, both):
        layer = cpu_native.DecoderLayerWeights.build(
            heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, eps=1e-6, scale=0.1,
            tensors={**tensors, **form},
        )  # fmt: skip
        cache = torch.zeros(tokens // block_size + 2, 2, block_size, KV_HEADS, HEAD_DIM)
        out = kernels.decoder_layers([layer], x, cos, sin, [cache], slots, tables, starts, lens, 0)
        results.append((out, cache))
    for out, cache in results[1:]:
        assert same_bits(out, results[0][0]) and same_bits(cache, results[0][1])


def _quantized_tiny_model(path) -> None:
    """A tiny Llama (head_dim 32, so its layers run as one native call) whose linears hold
    ggml round-tripped weights, several kinds per layer, but for one up projection; its LM head
    stays trained floats."""
    hf = make_hf_model("llama", seed=4, hidden_size=128, intermediate_size=192)
    kinds = iter(SIMPLE_QUANTS * 20)
    float_up = hf.model.layers[1].mlp.up_proj  # as a K-quant would stay: its gate drops codes
    with torch.no_grad():
        for module in hf.model.layers.modules():
            if isinstance(module, nn.Linear) and module is not float_up:
                module.weight.copy_(ggml_round_trip(module.weight, next(kinds)))
    hf.save_pretrained(path)
    make_tokenizer().save_pretrained(path)


@pytest.mark.parametrize("weight_format", ["auto", "coded"])
def test_an_engine_with_coded_weights_gives_the_float_engines_outputs(
    kernels: cpu_native.NativeKernels, tmp_path, weight_format: str
) -> None:
    """Greedy and sampled tokens and their logprobs, over decode steps and prompt steps past
    the rows that decode in registers, equal an engine's without codes, bit for bit (on the
    FMA path: see test_amx_linears.py for AMX)."""
    if kernels is not cpu_native.load():
        pytest.skip("the engine runs this machine's build")
    _quantized_tiny_model(tmp_path)
    prompts = [[7 + i, 19, 300 + i, 42] * (1 + 12 * (i % 2)) for i in range(6)]  # 4 and 52 tokens
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=0),
    ]
    outputs = {}
    for fmt in ("float32", weight_format):
        with LLM(
            str(tmp_path), dtype="float32", kv_cache_memory=0.01, max_model_len=128,
            cpu_weight_format=fmt, cpu_amx=False,
        ) as llm:  # fmt: skip
            model = llm.engine.gpu.runner.model
            linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
            coded = [m for m in linears if m.codes is not None]
            if fmt == "float32":
                assert not coded
            else:  # the linears of the two layers but one MLP's; the LM head stays float32
                assert len(coded) == 12 and model.lm_head.codes is None
                mlp = model.model.layers[1].mlp
                assert mlp.gate_proj.codes is mlp.up_proj.codes is None
                assert all((m.packed is not None) == (fmt == "auto") for m in coded)
            outputs[fmt] = [
                [(c.token_ids, c.logprobs) for c in out.outputs]
                for p in params
                for out in llm.generate(prompts, p, use_tqdm=False)
            ]
    assert outputs[weight_format] == outputs["float32"]


def test_state_dicts_give_back_the_float_weights(kernels: cpu_native.NativeKernels) -> None:
    gen = torch.Generator().manual_seed(8)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48), nn.Linear(64, 16, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(ggml_round_trip(model[0].weight, "Q5_1"))
        model[2].weight.copy_(torch.randn(16, 64, generator=gen))  # not coded
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for fmt in ("auto", "coded", "float32"):
        swapped = copy.deepcopy(model)
        use_native_kernels(swapped, kernels, weight_format=fmt)
        assert (swapped[0].codes is not None) == (fmt != "float32")
        assert swapped[2].codes is None  # random floats
        every = sum(p.numel() * p.element_size() for p in swapped.parameters())
        strips = swapped[0].packed.nbytes if fmt == "auto" else 0  # not read at batch 1
        assert latency.weight_bytes(swapped) == every - strips
        after = swapped.state_dict()
        assert sorted(after) == sorted(before)
        assert all(same_bits(after[k], before[k]) for k in before)


def test_decoder_layer_weights_refuse_a_gate_and_up_of_different_forms(
    kernels: cpu_native.NativeKernels,
) -> None:
    from tests.model.cpu.test_kernels import HEAD_DIM, HEADS, KV_HEADS, small_layer_tensors

    tensors = small_layer_tensors(torch.Generator().manual_seed(2))
    coded = {}
    for name in ("gate", "up"):
        weight = ggml_round_trip(packed_weights.unpack_weight(tensors[name]), "Q4_1")
        tensors[name] = packed_weights.pack_weight(weight)
        coded[name] = code_weight(weight, kernels.code_runs)
    gate, up = coded["gate"], coded["up"]
    for pair in (
        {"gate": gate},
        {"gate": CodedWeight(gate.codes, gate.scales, tensors["gate"]), "up": up},
    ):
        with pytest.raises(ValueError, match="gate and up must be packed alike"):
            cpu_native.DecoderLayerWeights.build(
                heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, eps=1e-6, scale=0.1,
                tensors={**tensors, **pair},
            )  # fmt: skip


def test_q4_0_blocks_off_the_reference_form_are_coded(kernels: cpu_native.NativeKernels) -> None:
    """Q4_0 blocks as a tuned quantizer (llama.cpp's with an importance matrix) may write them:
    each run's largest weight on code +7 (ggml's reference puts it on -8), the rest in [-5, 7],
    read back by gguf-py."""
    rng = np.random.default_rng(3)
    rows, runs = 32, 4
    d = (np.abs(rng.standard_normal((rows, runs, 1))) * 0.01 + 0.001).astype(np.float16)
    codes = rng.integers(-5, 8, size=(rows, runs, 32))
    codes[..., 0] = 7
    nibbles = (codes + 8).astype(np.uint8)
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # ggml: q[i] low, q[i + 16] high
    blocks = np.concatenate([d.view(np.uint8), packed], axis=-1).reshape(rows, -1)
    weight = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_0).astype(np.float32))
    assert weight.shape == (rows, runs * 32)
    coded = code_weight(weight, kernels.code_runs)
    assert coded is not None and same_bits(coded.decode(), weight)


@pytest.mark.parametrize("weight_format", ["auto", "coded"])
def test_plan_predicts_the_weights_of_a_gguf_with_mixed_tensor_types(
    kernels: cpu_native.NativeKernels, tmp_path, weight_format: str, caplog
) -> None:
    """Layer 1's up projection stays float32 (as a Q6_K would), so its gate keeps no codes
    either; layer 0's q projection is Q4_0, the rest Q4_1."""
    from aioinfer.cli.plan import build_plan_configs, make_plan
    from tests.model.loader.test_loader import write_gguf

    if kernels is not cpu_native.load():
        pytest.skip("the engine runs this machine's build")
    hf = make_hf_model("llama", seed=6, hidden_size=128, intermediate_size=192)

    def kind(name: str) -> GGMLQuantizationType | None:
        if name == "model.layers.1.mlp.up_proj.weight":
            return None
        if name == "model.layers.0.self_attn.q_proj.weight":
            return GGMLQuantizationType.Q4_0
        return GGMLQuantizationType.Q4_1 if name.startswith("model.layers.") else None

    path = write_gguf(hf, tmp_path / "Mixed.gguf", "llama", qtype=kind)
    make_tokenizer().save_pretrained(tmp_path / "tok")
    configs = build_plan_configs(
        {"model": str(path), "device": "cpu", "cpu_weight_format": weight_format}
    )
    planned = make_plan(*configs).weights_bytes
    with caplog.at_level(logging.INFO), LLM(
        str(path), tokenizer=str(tmp_path / "tok"), dtype="float32", kv_cache_memory=0.01,
        max_model_len=64, cpu_weight_format=weight_format,
    ) as llm:  # fmt: skip
        model = llm.engine.gpu.runner.model
        coded = [m for m in model.modules() if isinstance(m, PackedLinear) and m.codes is not None]
        assert len(coded) == 12  # 14 linears, less layer 1's up and its gate
        assert model.model.layers[0].self_attn.q_proj.codes is not None
        held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert planned == held
    assert "12 of 15 linear weights are exact byte codes" in caplog.text
