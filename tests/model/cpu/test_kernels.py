"""The native CPU kernels (model/cpu/kernels.c) against torch on fresh random inputs, float32.

Skipped, with the reason, where they cannot build (no AVX2 + FMA, no C compiler)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aioinfer.model.cpu import kernels as cpu_native
from aioinfer.model.cpu import packed_weights
from aioinfer.model.cpu.attention import NativeAttentionBackend
from aioinfer.model.cpu.layers import (
    NativeApplyRotary,
    NativeRMSNorm,
    NativeSiluAndMul,
    PackedLinear,
    use_native_kernels,
)
from aioinfer.model.layers.activation import SiluAndMul
from aioinfer.model.layers.norm import RMSNorm
from aioinfer.model.layers.rotary import ApplyRotary
from aioinfer.model.layers.torch_attention import decode_attention


@pytest.mark.parametrize(
    ("m", "n", "k"),
    # Rows around the micro-tile (14 rows with AVX-512, 6 with AVX2), odd and even strip
    # counts, K from 1 up; the last two span several row blocks (128 Ki floats of x each).
    [(1, 16, 1), (1, 48, 7), (3, 32, 64), (6, 16, 9), (7, 64, 40), (8, 80, 576),
     (9, 1536, 576), (14, 96, 576), (15, 32, 17), (17, 576, 1536), (29, 48, 100),
     (64, 192, 100), (130, 48, 33), (100, 32, 1536), (31, 16, 12000)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(
    kernels: cpu_native.NativeKernels, m: int, n: int, k: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    x = torch.randn(m, k, generator=gen)
    packed = PackedLinear(linear, kernels)
    expected = linear(x)
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5 * math.sqrt(k))
    # Leading dims and non-contiguous inputs behave as nn.Linear.
    x3 = torch.randn(k, 2, m, generator=gen).permute(1, 2, 0)
    torch.testing.assert_close(packed(x3), linear(x3), rtol=1e-5, atol=1e-5 * math.sqrt(k))


def test_swap_keeps_state_dict_names_and_skips_what_does_not_fit(
    kernels: cpu_native.NativeKernels,
) -> None:
    model = nn.Sequential(
        nn.Linear(24, 32),
        nn.Linear(32, 20),  # 20 is not a multiple of 16
        RMSNorm(32),
        RMSNorm(20),
        SiluAndMul(),
        ApplyRotary(),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_native_kernels(model, kernels) == 4
    kinds = [type(m) for m in model]
    assert kinds == [PackedLinear, nn.Linear, NativeRMSNorm, RMSNorm, NativeSiluAndMul,
                     NativeApplyRotary]  # fmt: skip
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 128)])
def test_rms_norm_matches_torch(kernels: cpu_native.NativeKernels, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    x = torch.randn(*shape, generator=gen) * 3
    expected = norm(x)
    torch.testing.assert_close(NativeRMSNorm(norm, kernels)(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 15, 16, 1536, 16 * 1536 + 3])
def test_silu_mul_matches_torch(kernels: cpu_native.NativeKernels, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    gate = torch.randn(n, generator=gen) * 6
    gate[:2] = torch.tensor([-100.0, 100.0])[: min(2, n)]  # the exp clamps
    up = torch.randn(n, generator=gen)
    expected = F.silu(gate) * up
    got = kernels.silu_mul(gate, up)
    assert got.data_ptr() == gate.data_ptr()  # in place, as the torch module
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 9, 64), (13, 2, 128), (3, 4, 48)])
def test_rotary_matches_torch(
    kernels: cpu_native.NativeKernels, tokens: int, heads: int, dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    x = torch.randn(tokens, heads, dim, generator=gen)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    expected = ApplyRotary()(x, cos, sin)
    # dim 48 has 24-wide halves: the twin falls back to torch for it.
    torch.testing.assert_close(NativeApplyRotary(kernels)(x, cos, sin), expected)


def random_paged_case(
    seed: int, block_size: int, head_dim: int, gqa: int, seq_lens: list[int], num_kv_heads: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [B, H, D], a cache whose unused slots hold NaN, shuffled block tables, seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    widths = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(widths) + 5
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order blocks
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    for b, (n, width) in enumerate(zip(seq_lens, widths, strict=True)):
        blocks = [free.pop() for _ in range(width)]
        tables[b, :width] = torch.tensor(blocks)
        for pos in range(n):  # only the slots a request owns hold numbers
            cache[blocks[pos // block_size], :, pos % block_size] = torch.randn(
                2, num_kv_heads, head_dim, generator=gen
            )
    query = torch.randn(len(seq_lens), num_kv_heads * gqa, head_dim, generator=gen)
    return query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])  # 64, 128: specialised; 80, 256 not
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("many", [False, True])
def test_paged_decode_matches_torch_reference(
    kernels: cpu_native.NativeKernels, block_size: int, head_dim: int, gqa: int, many: bool
) -> None:
    seed = block_size * 100 + head_dim + gqa + many
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 77]
    if many:  # enough requests for one work item per request, whatever the thread count
        seq_lens = (seq_lens * torch.get_num_threads())[: 2 * torch.get_num_threads() + 1]
        seq_lens += [5] * max(0, 2 * torch.get_num_threads() + 1 - len(seq_lens))
    else:  # one request: a work item per KV head
        seq_lens = [3 * block_size + 2]
    query, cache, tables, lens = random_paged_case(seed, block_size, head_dim, gqa, seq_lens)
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(query, cache, tables, lens, scale)
    expected = decode_attention(query, cache, tables, lens, max(seq_lens), scale)
    assert torch.isfinite(got).all()  # never reads the NaN slots past a request's length
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_paged_decode_shares_unequal_requests_among_any_threads(
    kernels: cpu_native.NativeKernels, threads: int
) -> None:
    """Each thread takes a contiguous run of requests by context length: one long request
    among short ones, more threads than requests, every request attended exactly once."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seq_lens in ([300, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 400], [5, 900, 17, 1, 33]):
            query, cache, tables, lens = random_paged_case(threads, 16, 64, 3, seq_lens)
            got = kernels.paged_decode_attention(query, cache, tables, lens, 0.125)
            expected = decode_attention(query, cache, tables, lens, max(seq_lens), 0.125)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def causal_chunk_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Reference: each request's chunk (its last query_len positions of seq_len) attends to
    its context up to and including each query's own position (with a sliding window, the last
    `window` positions up to it), K/V read from the cache; scores soft-capped to
    softcap * tanh(score / softcap) when softcap is set."""
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    group = query.shape[1] // kv_heads
    outs, start = [], 0
    for r, (n, length) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(length)
        blocks = tables[r, pos // block_size].long()
        keys = cache[blocks, 0, pos % block_size].repeat_interleave(group, 1)  # [L, H, D]
        values = cache[blocks, 1, pos % block_size].repeat_interleave(group, 1)
        q = query[start : start + n]
        scores = torch.einsum("thd,lhd->htl", q.double(), keys.double()) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(length - n, length)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if window:
            outside = pos[None, None, :] <= q_pos[None, :, None] - window
            scores.masked_fill_(outside, float("-inf"))
        outs.append(torch.einsum("htl,lhd->thd", scores.softmax(-1), values.double()))
        start += n
    return torch.cat(outs).float()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])  # 64, 128: specialised; 80 not
@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_paged_prefill_matches_torch_reference(
    kernels: cpu_native.NativeKernels, block_size: int, head_dim: int, gqa: int
) -> None:
    """Chunks after cached prefixes and fresh prompts, one token to more than two work items
    of queries (64 tokens each), across blocks; the unused cache slots hold NaN."""
    query_lens = [1, 7, 150, 2 * block_size + 3, 64]
    before = [0, 3 * block_size + 1, 0, block_size, 5]
    seq_lens = [q + b for q, b in zip(query_lens, before, strict=True)]
    seed = block_size * 100 + head_dim + gqa
    _, cache, tables, lens = random_paged_case(seed, block_size, head_dim, gqa, seq_lens)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(query_lens), 2 * gqa, head_dim, generator=gen)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    scale = head_dim**-0.5
    got = kernels.paged_prefill_attention(query, cache, tables, starts, lens, scale)
    expected = causal_chunk_attention(query, cache, tables, query_lens, seq_lens, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="query_start_loc must end"):
        kernels.paged_prefill_attention(query[:-1], cache, tables, starts, lens, scale)
    with pytest.raises(ValueError, match="block_tables must have shape"):
        kernels.paged_prefill_attention(query, cache, tables[:-1], starts, lens, scale)


def test_backend_decodes_natively_and_prefills_as_torch(kernels: cpu_native.NativeKernels) -> None:
    from aioinfer.model.layers.attention import AttentionMetadata
    from aioinfer.model.layers.torch_attention import TorchAttentionBackend

    gen = torch.Generator().manual_seed(7)
    block_size, kv_heads, head_dim, heads = 16, 2, 64, 8
    # Two decodes after 20 and 33 cached tokens, a 9-token chunk after 16, a whole 5-token prompt.
    query_lens, before = [1, 1, 9, 5], [20, 33, 16, 0]
    tables = [[1, 2], [3, 4, 5], [6, 7], [8]]
    metadata = AttentionMetadata.build(query_lens, before, tables, block_size)
    cache = torch.randn(9, 2, block_size, kv_heads, head_dim, generator=gen)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    ref_cache = cache.clone()
    got = NativeAttentionBackend(kernels).forward(q, k, v, cache, metadata, 0.125)
    expected = TorchAttentionBackend().forward(q, k, v, ref_cache, metadata, 0.125)
    assert torch.equal(cache, ref_cache)  # the same K/V writes
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_one_thread_gives_the_numbers_of_many(kernels: cpu_native.NativeKernels) -> None:
    # The kernels take torch's thread count: a single thread gives the same numbers.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(576, 1536, generator=gen)
    x = torch.randn(16, 1536, generator=gen)
    packed = packed_weights.pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.packed_linear(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, kernels.packed_linear(x, packed, None))
    torch.testing.assert_close(one, F.linear(x, w), rtol=1e-5, atol=1e-3)


def test_tied_embedding_reads_the_packed_head(kernels: cpu_native.NativeKernels) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    ids = torch.tensor([0, 5, 17, 63, 5])
    rows = model.embed(ids).detach()
    logits = model.head(rows).detach()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_native_kernels(model, kernels) == 2
    assert model.embed.packed is model.head.packed  # still one tensor
    assert sum(p.numel() for p in model.parameters()) == 64 * 32
    assert torch.equal(model.embed(ids), rows)
    torch.testing.assert_close(model.head(rows), logits, rtol=1e-5, atol=1e-5)
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_backend_selection_names_what_runs_and_refuses_what_cannot() -> None:
    from aioinfer.gpu.runner import select_attention_backend, select_cpu_kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = select_attention_backend("auto", cpu, torch.float32, 9, 3, 64)
    assert (native is None) == (cpu_native.load() is None)  # native wherever the kernels build
    assert select_attention_backend("auto", cpu, torch.bfloat16, 9, 3, 64) is None  # torch
    assert select_attention_backend("torch", cpu, torch.float32, 9, 3, 64) is None
    with pytest.raises(ValueError, match="CPU only"):
        select_attention_backend("native", cuda, torch.bfloat16, 9, 3, 64)
    with pytest.raises(ValueError, match="head_dim"):
        select_attention_backend("native", cpu, torch.float32, 9, 3, 24)
    with pytest.raises(ValueError, match="head_dim"):
        select_attention_backend("native", cpu, torch.float32, 9, 3, 512)
    model = nn.Sequential(nn.Linear(16, 16))
    assert select_cpu_kernels(model, "auto", cpu, torch.bfloat16) == "torch"
    assert select_cpu_kernels(model, "torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="float32 on the CPU"):
        select_cpu_kernels(model, "native", cuda, torch.float32)
    assert isinstance(model[0], nn.Linear)  # nothing swapped by the refusals


def test_kernels_refuse_tensors_they_would_misread(kernels: cpu_native.NativeKernels) -> None:
    packed = packed_weights.pack_weight(torch.randn(16, 8))
    with pytest.raises(ValueError, match="float32"):
        kernels.packed_linear(torch.randn(2, 8, dtype=torch.float64), packed, None)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.packed_linear(torch.randn(8, 2).t(), packed, None)


def test_exp_keeps_nan(kernels: cpu_native.NativeKernels) -> None:
    gate = torch.tensor([float("nan")] * 16 + [1.0] * 16)
    out = kernels.silu_mul(gate, torch.ones(32))
    assert out[:16].isnan().all() and torch.isfinite(out[16:]).all()


def _our_model_of(hf: nn.Module) -> nn.Module:
    from aioinfer.model.registry import get_model_class

    model = get_model_class(hf.config)(hf.config)
    model.load_state_dict(hf.state_dict(), strict=False)
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        # head_dim 32 qualifies for the one-call layer; the default tiny head_dim 16 does not.
        ("llama", {"hidden_size": 128, "attention_bias": True, "mlp_bias": True}),
        ("llama", {"num_key_value_heads": 4}),
        ("qwen2", {"hidden_size": 128}),  # q/k/v biases
        ("qwen3", {}),  # query and key norms, head_dim 32
    ],
)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_decoder_layers_match_the_torch_modules(
    kernels: cpu_native.NativeKernels,
    arch: str,
    overrides: dict,
    with_prompt: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each qualifying layer runs as one native call, for a decode-only step and for one with
    prompt tokens (a chunk after a cached prefix, a fresh prompt across blocks): the hidden
    states and K/V writes are torch's."""
    from aioinfer.model.cpu.layers import NativeDecoderLayer, NativeLlamaModel
    from aioinfer.model.forward_context import forward_context
    from aioinfer.model.layers.attention import AttentionMetadata
    from aioinfer.model.layers.torch_attention import TorchAttentionBackend
    from aioinfer.model.llama import LlamaModel
    from tests.support.tiny_models import make_hf_model

    hf = make_hf_model(arch, seed=5, **overrides)
    reference, native = _our_model_of(hf), _our_model_of(hf)
    use_native_kernels(native, kernels)
    cfg = native.config
    fused = sum(isinstance(m, NativeDecoderLayer) for m in native.modules())
    assert fused == (cfg.num_layers if cfg.head_dim % 32 == 0 else 0)
    # ... and a stack of such layers as one call for all of them
    assert isinstance(native.model, NativeLlamaModel) == bool(fused)

    gen = torch.Generator().manual_seed(11)
    block_size, num_blocks = 8, 24
    query_lens, before = [1, 1, 1, 1], [0, 7, 8, 30]
    if with_prompt:
        query_lens, before = [*query_lens, 6, 13], [*before, 3, 0]
    blocks = list(range(1, num_blocks))
    random.Random(2).shuffle(blocks)
    tables = []
    for q, b in zip(query_lens, before, strict=True):
        n = -(-(q + b) // block_size)
        tables.append(blocks[:n])
        blocks = blocks[n:]
    metadata = AttentionMetadata.build(query_lens, before, tables, block_size)
    shape = native.kv_cache_shape(num_blocks, block_size)
    caches = []
    for _ in range(cfg.num_layers):
        cache = torch.full(shape, float("nan"))  # slots past every context: never read
        for table, length in zip(tables, before, strict=True):
            for pos in range(length):
                cache[table[pos // block_size], :, pos % block_size] = torch.randn(
                    shape[1:2] + shape[3:], generator=gen
                )
        caches.append(cache)
    ref_caches = [c.clone() for c in caches]
    ids = torch.randint(0, cfg.vocab_size, (metadata.num_tokens,), generator=gen)

    calls = []
    monkeypatch.setattr(
        kernels,
        "decoder_layers",
        lambda *a: calls.append(a) or type(kernels).decoder_layers(kernels, *a),
    )
    with torch.no_grad():
        with forward_context(metadata, caches, NativeAttentionBackend(kernels)):
            got = native(ids, metadata.positions)
        with forward_context(metadata, ref_caches, TorchAttentionBackend()):
            expected = reference(ids, metadata.positions)
        assert len(calls) == (1 if fused else 0)  # every layer of the step in one call
        fallback_caches = [c.clone() for c in caches]
        with forward_context(metadata, fallback_caches, TorchAttentionBackend()):
            fallback = native(ids, metadata.positions)  # other backends: the modules one by one
        one_by_one_caches = [c.clone() for c in caches]
        with forward_context(metadata, one_by_one_caches, NativeAttentionBackend(kernels)):
            one_by_one = LlamaModel.forward(native.model, ids, metadata.positions)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fallback, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(one_by_one, got, rtol=0, atol=0)  # each layer a call of its own
    for cache, ref_cache in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert native.state_dict().keys() == reference.state_dict().keys()
    if fused and not with_prompt:  # a cache of another model's shape is refused, not misread
        layer = next(m for m in native.modules() if isinstance(m, NativeDecoderLayer))
        x = torch.randn(metadata.num_tokens, cfg.hidden_size)
        wrong = torch.zeros(num_blocks, 2, block_size, cfg.num_kv_heads + 1, cfg.head_dim)
        with pytest.raises(ValueError, match="kv_cache must have shape"):
            kernels.decoder_layers(
                [layer.weights], x, x[:, :16], x[:, :16], [wrong], metadata.slot_mapping,
                metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
                metadata.num_decodes,
            )  # fmt: skip
        stack = native.model.layer_weights
        step = (metadata.slot_mapping, metadata.block_tables, metadata.query_start_loc,
                metadata.seq_lens, metadata.num_decodes)  # fmt: skip
        with pytest.raises(ValueError, match=r"kv_caches\[1\] must have shape"):
            kernels.decoder_layers(stack, x, x[:, :16], x[:, :16], [caches[0], wrong], *step)
        with pytest.raises(ValueError, match="one KV cache per layer"):
            kernels.decoder_layers(stack, x, x[:, :16], x[:, :16], caches[:1], *step)
        other = cpu_native.DecoderLayerWeights.build(
            heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, eps=1e-6, scale=0.1,
            tensors=small_layer_tensors(),
        )  # fmt: skip
        with pytest.raises(ValueError, match="share their sizes"):
            kernels.decoder_layers([stack[0], other], x, x[:, :16], x[:, :16], caches, *step)


# A small decoder layer for the kernel's own checks: hidden 64, 2 query heads over 1 KV head of
# 32, MLP 128, no biases or query/key norms.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 2, 1, 32, 128


def random_packed(n: int, k: int, gen: torch.Generator | None = None) -> torch.Tensor:
    return packed_weights.pack_weight(torch.randn(n, k, generator=gen) * 0.1)


def small_layer_tensors(gen: torch.Generator | None = None) -> dict[str, torch.Tensor | None]:
    q, kv, hidden, inter = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HIDDEN, INTER
    shapes = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}  # fmt: skip
    return {
        "input_norm": torch.ones(hidden),
        "post_norm": torch.ones(hidden),
        "q_norm": None,
        "k_norm": None,
        **{name: random_packed(n, k, gen) for name, (n, k) in shapes.items()},
        **{f"{name}_bias": None for name in shapes},
    }


def test_decoder_layer_weights_refuse_what_the_kernel_would_misread() -> None:
    hidden, heads, kv_heads, head_dim, inter = HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER
    tensors = small_layer_tensors()
    sizes = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "eps": 1e-6}
    layer = cpu_native.DecoderLayerWeights.build(**sizes, scale=0.1, tensors=tensors)
    assert (layer.hidden, layer.intermediate) == (hidden, inter)
    with pytest.raises(ValueError, match="down must have shape"):
        cpu_native.DecoderLayerWeights.build(
            **sizes, scale=0.1, tensors={**tensors, "down": random_packed(hidden, inter + 16)}
        )
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        cpu_native.DecoderLayerWeights.build(
            **sizes, scale=0.1, tensors={**tensors, "q_norm": torch.ones(head_dim)}
        )
    with pytest.raises(ValueError, match="float32"):
        cpu_native.DecoderLayerWeights.build(
            **sizes, scale=0.1, tensors={**tensors, "up_bias": torch.ones(inter).double()}
        )
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_native.DecoderLayerWeights.build(
            **{**sizes, "head_dim": 16, "heads": 4, "kv_heads": 2}, scale=0.1, tensors=tensors
        )


def test_decoder_layer_calls_from_two_threads_do_not_share_scratch(
    kernels: cpu_native.NativeKernels,
) -> None:
    """Every engine of a process shares the kernels, each from its own thread."""
    from concurrent.futures import ThreadPoolExecutor

    hidden, kv_heads, head_dim, block_size = HIDDEN, KV_HEADS, HEAD_DIM, 8
    layer = cpu_native.DecoderLayerWeights.build(
        heads=HEADS, kv_heads=kv_heads, head_dim=head_dim, eps=1e-6, scale=0.1,
        tensors=small_layer_tensors(torch.Generator().manual_seed(3)),
    )  # fmt: skip

    def step(tokens: int, seed: int) -> torch.Tensor:
        """A fresh prompt of `tokens` tokens in blocks 1.. of its own cache."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=g)
        cos, sin = torch.rand(2, tokens, head_dim // 2, generator=g)
        cache = torch.zeros(tokens // block_size + 2, 2, block_size, kv_heads, head_dim)
        slots = torch.arange(block_size, block_size + tokens)
        tables = torch.arange(1, tokens // block_size + 2, dtype=torch.int32)[None]
        starts = torch.tensor([0, tokens], dtype=torch.int32)
        lens = torch.tensor([tokens], dtype=torch.int32)
        return kernels.decoder_layers([layer], x, cos, sin, [cache], slots, tables, starts, lens, 0)

    cases = [(300, 1), (40, 2)] * 8  # different sizes: the scratch is grown and reused
    expected = [step(*case) for case in cases]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda case: step(*case), cases))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
