"""The Llama decoder; Qwen2, Qwen3, Mistral and their mixtures of experts are configurations
of it.

Parameter names mirror Hugging Face checkpoint keys (`model.layers.0.self_attn.q_proj.weight`,
...), so weights load by name. Construction does no data-dependent work, so a model can be built
under `torch.device("meta")` and have its weights assigned afterwards; call `tie_weights()` once
they are in place.

The forward pass takes one flat batch of all requests' tokens (prefill chunks and decodes mixed);
attention reads its metadata and KV cache from the active `forward_context`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import aioinfer.sizing as sizing
from aioinfer.model.forward_context import get_forward_context
from aioinfer.model.layers.activation import SiluAndMul
from aioinfer.model.layers.attention import Attention, kv_cache_shape
from aioinfer.model.layers.moe import SparseMoeBlock, WeightSlot
from aioinfer.model.layers.norm import RMSNorm
from aioinfer.model.layers.rotary import (
    ApplyRotary,
    RopeConfig,
    RotaryEmbedding,
    rope_config_from_hf,
)


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """The settings the decoder reads from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Per-head RMSNorm of queries and keys before rotary (Qwen3).
    qk_norm: bool = False
    # What attention scores are scaled by; None: head_dim ** -0.5.
    attention_scale: float | None = None
    # Scores soft-capped to softcap * tanh(score / softcap) (Gemma 2), or 0.
    attention_softcap: float = 0.0
    # RMSNorms of hidden_size in each layer: Llama's two, Gemma's four.
    norms_per_layer: int = 2
    # Partial rotary (Phi-4-mini): only each head's first rotary_dim dims rotate; 0: all.
    rotary_dim: int = 0
    # Each layer's sliding window in tokens, 0 for full attention (sizing.sliding_windows);
    # empty: none anywhere.
    sliding_windows: tuple[int, ...] = ()
    # Mixture of experts: in `sparse_layers` the MLP is a router over `num_experts` MLPs of
    # `expert_intermediate_size`, of which each token takes `experts_per_token`, their weights
    # scaled to sum to 1 when `renormalize_routing`; plus, when its size is set, a shared
    # expert that every token takes (Qwen2-MoE). The other layers keep the dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    renormalize_routing: bool = True
    shared_expert_intermediate_size: int = 0


class MergedLinear(nn.Module):
    """Linears of one input as one GEMM: their weights (and biases) concatenated by output
    features, and the originals' parameters re-pointed to slices of it, so state dicts, loading
    into them and memory are unchanged. Build it on the model's final device: moving the model
    afterwards would copy the slices apart. The output splits back with `.split(self.sizes, -1)`.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        if len({lin.bias is None for lin in linears}) != 1:
            raise ValueError("merged linears must all have a bias or all have none")
        self.sizes = [lin.out_features for lin in linears]
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = None
        if linears[0].bias is not None:
            bias = torch.cat([lin.bias.detach() for lin in linears])  # type: ignore[union-attr]
        for i, (lin, part) in enumerate(zip(linears, weight.split(self.sizes), strict=True)):
            lin.weight = nn.Parameter(part, requires_grad=False)
            if bias is not None:
                lin.bias = nn.Parameter(bias.split(self.sizes)[i], requires_grad=False)
        # Buffers outside the state dict: the originals' parameters stay its only entries.
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def linear_into(residual: torch.Tensor | None, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """linear(x), plus residual when given: summed inside the GEMM (addmm) where the linear has
    no bias, one kernel instead of two on a GPU, and the product rounded once instead of twice."""
    if residual is None:
        return linear(x)
    if linear.bias is not None:
        return residual + linear(x)
    return torch.addmm(residual, x, linear.weight.t())


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_fn: nn.Module = SiluAndMul()
        # gate and up as one GEMM, set by `LlamaForCausalLM.fuse_gemms`.
        self.gate_up_proj: MergedLinear | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x, plus residual when given (see `linear_into`)."""
        # One expression each, so that `up` is freed before down_proj runs (the activation
        # peak the memory profile plans for).
        if self.gate_up_proj is not None:
            merged = self.gate_up_proj
            act = self.act_fn(*merged(x).split(merged.sizes, dim=-1))
        else:
            act = self.act_fn(self.gate_proj(x), self.up_proj(x))
        return linear_into(residual, act, self.down_proj)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = ApplyRotary()
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else 0
        self.attn = Attention(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            layer_idx,
            cfg.attention_scale,
            window,
            cfg.attention_softcap,
        )
        # q, k and v as one GEMM, set by `LlamaForCausalLM.fuse_gemms`.
        self.qkv_proj: MergedLinear | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over x, plus residual when given (see `linear_into`)."""
        t = x.shape[0]
        if self.qkv_proj is not None:
            # Strided views of one output: the norms, rotary and KV store read their strides.
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        out = self.attn(self._rotate(q, cos, sin), self._rotate(k, cos, sin), v)
        return linear_into(residual, out.reshape(t, self.num_heads * self.head_dim), self.o_proj)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by cos/sin [T, rotary_dim // 2]: its first rotary_dim
        dims, the others passed through."""
        if self.rotary_dim == self.head_dim:
            return self.rotary(x, cos, sin)
        rotated = self.rotary(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


def fuse_projections(attn: LlamaAttention, mlp: nn.Module) -> None:
    """q/k/v as one GEMM, and gate/up as one where the MLP is dense (see `MergedLinear`)."""
    attn.qkv_proj = MergedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
    if isinstance(mlp, LlamaMLP):
        mlp.gate_up_proj = MergedLinear([mlp.gate_proj, mlp.up_proj])


class LlamaDecoderLayer(nn.Module):
    # The residual adds inside the o_proj and down_proj GEMMs, set by `LlamaForCausalLM.fuse_gemms`.
    residual_in_gemm = False

    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            _sparse_mlp(cfg) if layer_idx in cfg.sparse_layers else LlamaMLP(cfg)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.residual_in_gemm:
            x = self.self_attn(self.input_layernorm(x), cos, sin, residual=x)
            return self.mlp(self.post_attention_layernorm(x), residual=x)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def _sparse_mlp(cfg: DecoderConfig) -> SparseMoeBlock:
    shared = None
    if cfg.shared_expert_intermediate_size:
        shared = LlamaMLP(cfg, cfg.shared_expert_intermediate_size)
    return SparseMoeBlock(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.experts_per_token,
        cfg.expert_intermediate_size,
        cfg.renormalize_routing,
        shared,
    )


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        layer_class: type[nn.Module] = LlamaDecoderLayer,
        norm_class: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.rope)

    def rotary_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos and sin; LongRoPE's tokens past the original context are marked in
        the step's metadata."""
        long_rows = None
        if self.rotary_emb.has_long_factors:
            long_rows = get_forward_context().attn_metadata.long_rope_rows
        return self.rotary_emb(positions, dtype, long_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """`model(input_ids [T], positions [T]) -> hidden [T, hidden]`; logits via `compute_logits`."""

    # Where the architecture applies a config's sliding_window, as its transformers class does
    # (sizing.sliding_windows): None, nowhere (Llama); "all" layers (Mistral, Mixtral, Phi-3);
    # the "layer_types" that name it (Qwen, Gemma).
    sliding_window_layers: str | None = None

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.config = self.decoder_config(hf_config)
        self.model = self.decoder_stack()
        self.lm_head: nn.Linear | None = nn.Linear(
            self.config.hidden_size, self.config.vocab_size, bias=False
        )
        self.score: nn.Linear | None = None  # a classifier's head, set by `add_classifier`
        self.tie_weights()

    @classmethod
    def decoder_config(cls, hf_config: Any) -> DecoderConfig:
        """Read and validate the decoder settings of a Hugging Face config."""
        cls._check_supported(hf_config)
        num_heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return DecoderConfig(
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope=cls.rope_config(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_windows=sizing.sliding_windows(hf_config, cls.sliding_window_layers),
            **cls._arch_options(hf_config),
            **cls._moe_options(hf_config),
        )

    @classmethod
    def rope_config(cls, hf_config: Any) -> RopeConfig:
        """The rotary embedding of the decoder's layers."""
        return rope_config_from_hf(hf_config)

    def decoder_stack(self) -> LlamaModel:
        """`self.model`: the embedding, the decoder layers and the final norm."""
        return LlamaModel(self.config)

    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        """Biases and norms that differ between architectures sharing this decoder."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "mlp_bias": bool(getattr(hf_config, "mlp_bias", False)),
            "qk_norm": False,
        }

    @classmethod
    def _moe_options(cls, hf_config: Any) -> dict[str, Any]:
        """The mixture-of-experts fields of DecoderConfig (none: every MLP is dense)."""
        return {}

    @classmethod
    def _check_supported(cls, hf_config: Any) -> None:
        """Raise ValueError for settings the decoder would silently get wrong."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {act!r}")

    # How checkpoints name a sparse layer's block and an expert's gate, up and down weights.
    checkpoint_expert_names = ("mlp", "gate_proj", "up_proj", "down_proj")

    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        """Checkpoint keys that are no parameter's name, and where their tensors go: each
        expert's weights fill its rows of the layer's stacked expert weights."""
        cfg = self.config
        block, gate, up, down = self.checkpoint_expert_names
        inter = cfg.expert_intermediate_size
        slots: dict[str, WeightSlot] = {}
        for layer in cfg.sparse_layers:
            ours, theirs = f"model.layers.{layer}.mlp", f"model.layers.{layer}.{block}"
            if theirs != ours:
                slots[f"{theirs}.gate.weight"] = WeightSlot(f"{ours}.gate.weight")
            gate_up, down_proj = f"{ours}.experts.gate_up_proj", f"{ours}.experts.down_proj"
            for e in range(cfg.num_experts):
                expert = f"{theirs}.experts.{e}"
                slots[f"{expert}.{gate}.weight"] = WeightSlot(gate_up, e, 0, inter)
                slots[f"{expert}.{up}.weight"] = WeightSlot(gate_up, e, inter, inter)
                slots[f"{expert}.{down}.weight"] = WeightSlot(down_proj, e)
        return slots

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them; call after loading."""
        if self.config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def drop_lm_head(self) -> None:
        """For embeddings: the final hidden states are the output, so the head is never built
        into memory nor read from the checkpoint (`compute_logits` is then unavailable)."""
        self.lm_head = None

    def add_classifier(self, num_labels: int) -> None:
        """For a `*ForSequenceClassification` checkpoint: its `score` head, [num_labels, hidden]
        without bias, which the runner applies to the last token's final hidden state."""
        self.drop_lm_head()
        self.score = nn.Linear(self.config.hidden_size, num_labels, bias=False)

    def fuse_gemms(self) -> None:
        """Fewer, larger kernels per layer for the GPU path, once the weights are loaded on
        their final device: q/k/v and gate/up as one GEMM each, and the two residual adds
        inside the o_proj and down_proj GEMMs."""
        for module in self.model.layers:
            layer: LlamaDecoderLayer = module  # type: ignore[assignment]
            fuse_projections(layer.self_attn, layer.mlp)  # type: ignore[arg-type]
            layer.residual_in_gemm = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden_size] -> float32 logits [N, vocab_size]."""
        if self.lm_head is None:
            raise RuntimeError("this model was loaded for embeddings, without its LM head")
        return self.lm_head(hidden_states).float()

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Each row's index of the largest of `compute_logits(hidden_states)` (the first on
        ties) where the LM head finds it without computing every logit, else None. A subclass
        whose compute_logits changes the logits must override this."""
        greedy = getattr(self.lm_head, "greedy", None)
        return None if greedy is None else greedy(hidden_states)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of each of the `config.num_layers` KV-cache tensors."""
        cfg = self.config
        return kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window."""

    sliding_window_layers = "all"
