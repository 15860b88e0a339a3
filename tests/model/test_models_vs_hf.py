"""Our decoders over the paged KV cache against Hugging Face transformers, float32 on the CPU.

Each variant runs full prefills, chunked prefills with a shared cached prefix, and greedy decode
mixed with a prefill, on a cache whose blocks are handed out in shuffled order and start as NaN.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cache

import pytest
import torch
from transformers import PreTrainedModel

from aioinfer.model.forward_context import forward_context
from aioinfer.model.layers.attention import AttentionMetadata
from aioinfer.model.layers.rotary import compute_inv_freq, rope_config_from_hf
from aioinfer.model.llama import LlamaForCausalLM, MergedLinear
from aioinfer.model.registry import get_model_class
from tests.support.tiny_models import VARIANTS, make_hf_model, make_variant

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64


@cache
def hf_model(variant: str) -> PreTrainedModel:
    return make_variant(variant)


@cache
def our_model(variant: str, fused: bool = False) -> LlamaForCausalLM:
    """Ours with the HF model's weights; `fused`: q/k/v and gate/up as one GEMM each and the
    residual adds inside GEMMs, as on the GPU path."""
    hf = hf_model(variant)
    model = get_model_class(hf.config)(hf.config)
    result = model.load_state_dict(hf.state_dict(), strict=False)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    model.tie_weights()
    if fused:
        model.fuse_gemms()
    return model.eval()


@torch.no_grad()
def hf_logits(variant: str, token_ids: list[int]) -> torch.Tensor:
    return hf_model(variant)(torch.tensor([token_ids])).logits[0].float()


def random_prompt(rng: random.Random, length: int, vocab: int = 512) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRun:
    """A KV cache with shuffled free blocks, and one forward pass per `step`."""

    def __init__(self, model: LlamaForCausalLM, seed: int = 0) -> None:
        self.model = model
        shape = model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
        self.kv_caches = [torch.full(shape, float("nan")) for _ in range(model.config.num_layers)]
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def _reserve(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.blocks) * BLOCK_SIZE < num_tokens:
            seq.blocks.append(self.free.pop())

    @torch.no_grad()
    def step(self, feeds: list[tuple[Seq, int]], last_only: bool = False) -> list[torch.Tensor]:
        """Feed each seq its next n tokens; logits [n, vocab] per feed ([1, vocab] if last_only)."""
        for seq, n in feeds:
            self._reserve(seq, seq.computed + n)
        meta = AttentionMetadata.build(
            query_lens=[n for _, n in feeds],
            context_lens_before=[seq.computed for seq, _ in feeds],
            block_tables=[seq.blocks for seq, _ in feeds],
            block_size=BLOCK_SIZE,
        )
        ids = torch.tensor([t for seq, n in feeds for t in seq.tokens[seq.computed :][:n]])
        positions = torch.cat([torch.arange(s.computed, s.computed + n) for s, n in feeds])
        with forward_context(meta, self.kv_caches):
            hidden = self.model(ids, positions)
        for seq, n in feeds:
            seq.computed += n
        if last_only:
            last = torch.tensor(meta.query_start_loc_host[1:]) - 1
            return list(self.model.compute_logits(hidden[last]).split(1))
        return list(self.model.compute_logits(hidden).split([n for _, n in feeds]))


def check_feed(variant: str, seq: Seq, logits: torch.Tensor) -> None:
    """Logits of the seq's last fed tokens vs HF's over the whole sequence so far."""
    ref = hf_logits(variant, seq.tokens[: seq.computed])[-logits.shape[0] :]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


VARIANT_NAMES = sorted(VARIANTS)


def run_and_check(variant: str, run: PagedRun, feeds: list[tuple[Seq, int]]) -> None:
    for (seq, _), logits in zip(feeds, run.step(feeds), strict=True):
        check_feed(variant, seq, logits)


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_full_prefill_flat_batch(variant: str) -> None:
    rng = random.Random(1)
    seqs = [Seq(random_prompt(rng, n)) for n in (1, 7, 16, 13, 30)]
    run_and_check(variant, PagedRun(our_model(variant)), [(s, len(s.tokens)) for s in seqs])


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_chunked_prefill_with_cached_prefix(variant: str, fused: bool) -> None:
    rng = random.Random(2)
    run = PagedRun(our_model(variant, fused))
    a = Seq(random_prompt(rng, 21))
    c = Seq(random_prompt(rng, 11))
    run_and_check(variant, run, [(a, 21), (c, 6)])
    # b starts with a's first two full blocks, already in the cache as after a prefix hit.
    shared = 2 * BLOCK_SIZE
    b = Seq(a.tokens[:shared] + random_prompt(rng, 9), computed=shared, blocks=a.blocks[:2])
    run_and_check(variant, run, [(c, 3), (b, 5)])
    run_and_check(variant, run, [(b, 1), (c, 2)])
    run_and_check(variant, run, [(b, 3)])
    assert b.computed == len(b.tokens) and c.computed == len(c.tokens)


def append_greedy(variant: str, seq: Seq) -> None:
    seq.tokens.append(int(hf_logits(variant, seq.tokens)[-1].argmax()))


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_greedy_decode_mixed_with_prefill(variant: str, fused: bool) -> None:
    rng = random.Random(3)
    run = PagedRun(our_model(variant, fused))
    decoding = [Seq(random_prompt(rng, n)) for n in (6, 11, 3)]
    late = Seq(random_prompt(rng, 9))
    for seq, logits in zip(decoding, run.step([(s, len(s.tokens)) for s in decoding]), strict=True):
        check_feed(variant, seq, logits[-1:])
        append_greedy(variant, seq)

    late_chunks = [5, 4]  # the late prompt is prefilled in chunks beside the decodes
    for step in range(8):
        feeds = [(s, 1) for s in decoding]
        if step < len(late_chunks):
            # Leading one-token requests are batched as decodes, the others take the prefill path.
            late_feed = (late, late_chunks[step])
            feeds = [*feeds, late_feed] if step % 2 == 0 else [late_feed, *feeds]
        elif step == len(late_chunks):
            decoding.append(late)
            feeds.append((late, 1))
        for (seq, _), logits in zip(feeds, run.step(feeds, last_only=True), strict=True):
            check_feed(variant, seq, logits)
            if seq.computed == len(seq.tokens):
                append_greedy(variant, seq)
    assert all(len(s.tokens) == s.computed + 1 for s in decoding)


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2", "qwen3"])
def test_meta_build_and_assign_load(variant: str) -> None:
    hf = hf_model(variant)
    with torch.device("meta"):
        model = get_model_class(hf.config)(hf.config)
    assert set(model.state_dict()) == set(hf.state_dict())
    assert all(p.is_meta for p in model.parameters())
    model.load_state_dict(hf.state_dict(), assign=True)
    model.tie_weights()
    assert not any(p.is_meta for p in model.parameters())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == hf.config.tie_word_embeddings
    seq = Seq(random_prompt(random.Random(4), 10))
    (logits,) = PagedRun(model.eval()).step([(seq, 10)])
    check_feed(variant, seq, logits)


def test_merged_projections_share_storage_and_keep_the_state_dict() -> None:
    """The originals' parameters become slices of the merged weight: same state dict keys and
    values, no second copy of the weights, and a load into the state dict reaches the GEMM."""
    hf = hf_model("qwen2")  # q/k/v biases
    model = get_model_class(hf.config)(hf.config)
    model.load_state_dict(hf.state_dict(), strict=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    num_parameters = sum(p.numel() for p in model.parameters())
    model.fuse_gemms()
    assert sum(p.numel() for p in model.parameters()) == num_parameters
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, atol=0, rtol=0)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj is not None
    merged = attn.qkv_proj.weight
    assert attn.k_proj.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    assert attn.qkv_proj.bias is not None
    assert (
        attn.v_proj.bias.untyped_storage().data_ptr()
        == attn.qkv_proj.bias.untyped_storage().data_ptr()
    )
    new_v = torch.randn_like(attn.v_proj.weight)
    model.load_state_dict({"model.layers.0.self_attn.v_proj.weight": new_v}, strict=False)
    torch.testing.assert_close(merged[-new_v.shape[0] :], new_v, atol=0, rtol=0)


def test_merging_linears_with_and_without_bias_is_refused() -> None:
    with pytest.raises(ValueError, match="all have a bias or all have none"):
        MergedLinear([torch.nn.Linear(4, 2), torch.nn.Linear(4, 2, bias=False)])


def test_llama3_inv_freq_matches_hf() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_model("llama3-rope")
    rope = rope_config_from_hf(hf.config)
    assert rope.rope_type == "llama3"
    assert rope.theta == 500000.0
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    torch.testing.assert_close(compute_inv_freq(16, rope), expected, atol=0, rtol=0)


def test_registry() -> None:
    for arch in ("llama", "qwen2", "qwen3"):
        config = make_hf_model(arch).config
        assert get_model_class(config).__name__ == config.architectures[0]
    config = make_hf_model("llama").config
    config.architectures = ["MistralForCausalLM"]
    assert issubclass(get_model_class(config), LlamaForCausalLM)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class(config)


def test_unsupported_settings_raise() -> None:
    config = make_hf_model("llama").config
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaForCausalLM(config)


def test_sliding_windows_per_layer_as_transformers_applies_them() -> None:
    """Qwen slides from max_window_layers on and only with use_sliding_window; Mistral slides
    on every layer whatever layer_types says, Llama nowhere; the window no longer caps the
    context."""
    from aioinfer import sizing
    from aioinfer.model.llama import MistralForCausalLM

    window = {"use_sliding_window": True, "sliding_window": 32}
    config = make_hf_model("qwen2", **window, max_window_layers=1).config
    assert sizing.sliding_windows(config, "layer_types") == (0, 32)
    assert get_model_class(config).decoder_config(config).sliding_windows == (0, 32)
    assert sizing.max_model_len(config, None) == 256
    assert LlamaForCausalLM.decoder_config(config).sliding_windows == (0, 0)  # Llama ignores it
    config = make_hf_model("qwen2", **window).config
    assert sizing.sliding_windows(config, "layer_types") == (0, 0)
    config = make_hf_model("qwen2", sliding_window=32).config  # named, never applied
    assert sizing.sliding_windows(config, "layer_types") == (0, 0)
    mistral = {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]}
    config = make_hf_model("mistral", **mistral).config
    assert MistralForCausalLM.decoder_config(config).sliding_windows == (4, 4)


def test_gemma_ignores_hidden_act() -> None:
    """transformers' Gemma reads hidden_activation; a config that also names hidden_act loads."""
    config = make_hf_model("gemma3", hidden_act="gelu_pytorch_tanh").config
    assert get_model_class(config)(config).config.num_layers == 3
    with pytest.raises(ValueError, match="hidden_activation must be 'gelu_pytorch_tanh'"):
        get_model_class(config).decoder_config(
            make_hf_model("gemma3", hidden_activation="relu").config
        )


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("mistral", {"sliding_window": 8}),
        ("mixtral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("gemma3", {"final_logit_softcapping": 30.0}),  # sliding and full layers, 8 tokens
        ("gemma2", {}),  # soft-capped scores and logits
    ],
)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_sliding_windows_equal_transformers_past_the_window(
    tmp_path, arch: str, overrides: dict, backend: str
) -> None:
    """Prompts and outputs far past an 8-token window, in chunks of 16 tokens with prefix-cache
    hits: greedy outputs token for token equal to transformers'."""
    from tests.offline.test_llm_vs_hf import hf_greedy, make_prompts, run_llm
    from tests.support.tokenizers import make_tokenizer

    hf = make_hf_model(arch, **overrides)
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = make_prompts(2, 512, lengths=(1, 7, 9, 30, 45))
    prompts.append([*prompts[-1][:40], 5, 6, 7])  # a prefix-cache hit of 32 tokens
    got = run_llm(tmp_path, prompts, attention_backend=backend, max_num_batched_tokens=16)
    assert run_llm.last_stats[1] > 0  # type: ignore[attr-defined]
    assert got == [hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32},
        {
            "factor": 8.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16,
            "truncate": False,
        },
        {
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.5},
        {"factor": None, "original_max_position_embeddings": 64},  # 256 / 64 = 4
    ],
)
def test_yarn_frequencies_and_attention_factor_equal_transformers(scaling) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from aioinfer.model.layers.rotary import attention_factor

    hf = make_hf_model("qwen2", rope_scaling={"rope_type": "yarn", **scaling}, rope_theta=1e6)
    rope = rope_config_from_hf(hf.config)
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config, "cpu")
    torch.testing.assert_close(compute_inv_freq(16, rope), expected, atol=0, rtol=1e-6)
    assert attention_factor(rope) == pytest.approx(expected_factor, rel=1e-12)


def test_a_yarn_model_through_the_engine(tmp_path) -> None:
    """Built on the meta device and loaded, as the engine builds it."""
    from aioinfer import LLM
    from tests.offline.test_llm_vs_hf import GREEDY, hf_greedy, make_prompts
    from tests.support.tokenizers import make_tokenizer

    hf = hf_model("qwen2-yarn")
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    prompts = make_prompts(0, 512, lengths=(3, 40))  # past the original 32 positions
    with LLM(str(tmp_path), dtype="float32", kv_cache_memory=0.01) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p) for p in prompts]


def test_the_bundled_gemma_3_1b_has_the_real_shapes() -> None:
    """The config `--load-format dummy` benchmarks with: parameters as transformers' in name
    and shape, five sliding layers of 512 tokens to each full one, each kind with its rotary
    base, and `aioinfer plan`'s parameter count."""
    from aioinfer.cli.plan import count_parameters
    from tests.support.tiny_models import bundled_model_and_reference

    _, ours, ref = bundled_model_and_reference("google/gemma-3-1b-it")
    assert ours.config.sliding_windows == ((512,) * 5 + (0,)) * 4 + (512,) * 2
    assert ours.config.rope.theta == 1_000_000.0
    assert ours.model.sliding_rotary_emb.rope.theta == 10_000.0
    assert count_parameters(ours.config) == ref.num_parameters()
