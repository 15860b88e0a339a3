"""The native CPU kernels as drop-in modules, swapped into a loaded float32 model.

`use_native_kernels(model, kernels)` replaces, in place:
- every float32 `nn.Linear` whose out_features is a multiple of 16 by a `PackedLinear` that
  holds only the packed weight (an embedding tied to it then looks rows up in the packed weight);
- `RMSNorm`, `SiluAndMul` and `ApplyRotary` by one native call each instead of several torch
  ops, where their sizes fit the kernels;
- then every decoder layer whose parts all became native by a `NativeDecoderLayer`, which runs
  the whole layer as one native call for every step;
- then every decoder stack whose layers all became native by a `NativeLlamaModel`, which runs
  all of its layers as one native call.
Each replacement takes and returns what the module it replaces does, so the model code is the
same on every device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from aioinfer.model.cpu import codes_cache
from aioinfer.model.cpu.attention import NativeAttentionBackend
from aioinfer.model.cpu.greedy_head import GreedyHead
from aioinfer.model.cpu.kernels import (
    STRIP,
    DecoderLayerWeights,
    NativeKernels,
)
from aioinfer.model.cpu.packed_weights import (
    CodedWeight,
    PackedWeight,
    code_weight,
    pack_weight,
    unpack_weight,
)
from aioinfer.model.forward_context import get_forward_context
from aioinfer.model.layers.activation import SiluAndMul
from aioinfer.model.layers.norm import RMSNorm
from aioinfer.model.layers.rotary import ApplyRotary
from aioinfer.model.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel

logger = logging.getLogger(__name__)

# A weight [N, K] -> its byte codes, or None where it has none.
Coder = Callable[[torch.Tensor], CodedWeight | None]


class PackedLinear(nn.Module):
    """`y = x @ W^T + b` by the native kernel, with the inputs and outputs of nn.Linear. W is
    packed as float32 strips; with `code` "auto" or "coded", also or only held as byte codes
    where they rebuild every weight bit for bit (GGUF's simple quantizations; see
    packed_weights.py). With `amx` on a CPU with AMX, steps of many rows read the codes on
    AMX instead of float32 strips, which are not kept then; with `code` "auto", codes whose
    weights split into two bfloat16 parts are kept as those too, for the steps of the most
    rows (kernels.c, "AMX linears from weight parts")."""

    def __init__(
        self,
        linear: nn.Linear,
        kernels: NativeKernels,
        *,
        code: str = "float32",
        amx: bool = False,
        coder: Coder | None = None,
    ) -> None:
        """`coder`: finds the weight's codes (default: code_weight; see WeightCoder)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        wanted = code in ("auto", "coded")
        find = coder or (lambda weight: code_weight(weight, kernels.code_runs))
        coded = find(linear.weight) if wanted else None
        self.amx = coded is not None and amx and kernels.has_amx
        self.packed: nn.Parameter | None = None
        if coded is None or (code == "auto" and not self.amx):
            self.packed = nn.Parameter(pack_weight(linear.weight), requires_grad=False)
        self.codes: nn.Parameter | None = None
        self.scales: nn.Parameter | None = None
        self.parts: nn.Parameter | None = None
        if coded is not None:  # parameters, so that the model's weight memory counts them
            self.codes = nn.Parameter(coded.codes, requires_grad=False)
            self.scales = nn.Parameter(coded.scales, requires_grad=False)
            if self.amx and code == "auto":  # as strips would be beside codes on the FMA path
                parts = kernels.weight_parts(coded.codes, coded.scales)
                if parts is not None:
                    self.parts = nn.Parameter(parts, requires_grad=False)
        self.bias = linear.bias
        self.kernels = kernels
        # On a model's LM head: its rows' argmax without every logit (set by use_native_kernels).
        self.greedy: GreedyHead | None = None
        # State dicts keep Hugging Face's names and layout: `weight` [N, K], not the strips.
        self._register_state_dict_hook(_unpacked_state)

    @property
    def weight_form(self) -> PackedWeight:
        """The weight as the kernels take it: the strips, or the codes."""
        if self.codes is None or self.scales is None:
            assert self.packed is not None
            return self.packed
        return CodedWeight(self.codes, self.scales, self.packed, self.amx, self.parts)

    def drop_codes(self) -> None:
        """Keep the weight as float32 strips only (the same floats)."""
        if self.packed is None:
            weight = self.weight_form.decode()  # type: ignore[union-attr]
            self.packed = nn.Parameter(pack_weight(weight), requires_grad=False)
        self.codes = self.scales = self.parts = None
        self.amx = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).contiguous()
        out = self.kernels.packed_linear(rows, self.weight_form, self.bias)
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        form = ", ".join(n for n in ("packed", "codes", "parts") if getattr(self, n) is not None)
        form += ", amx" if self.amx else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {form}"


def _unpacked_state(
    module: nn.Module, state: dict[str, torch.Tensor], prefix: str, _meta: object
) -> None:
    packed = state.pop(prefix + "packed", None)
    if packed is not None:
        state[prefix + "weight"] = unpack_weight(packed)
    if prefix + "codes" in state:
        coded = CodedWeight(state.pop(prefix + "codes"), state.pop(prefix + "scales"))
        if packed is None:  # codes alone
            state[prefix + "weight"] = coded.decode()


class PackedEmbedding(nn.Module):
    """The lookup of a tied embedding that reads the LM head's packed weight, so the two still
    share one tensor: row t of W is packed[t // 16, :, t % 16]."""

    def __init__(self, embedding: nn.Embedding, packed: nn.Parameter) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.packed = packed
        self._register_state_dict_hook(_unpacked_state)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed[ids // STRIP, :, ids % STRIP]


class NativeRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm, kernels: NativeKernels) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class NativeSiluAndMul(SiluAndMul):
    def __init__(self, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate, up)


class NativeApplyRotary(ApplyRotary):
    def __init__(self, kernels: NativeKernels) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % (2 * STRIP):  # each half must fill whole 16-lane registers
            return super().forward(x, cos, sin)
        return self.kernels.rotary(x, cos, sin)


class NativeDecoderLayer(LlamaDecoderLayer):
    """A decoder layer that runs as one native call (`NativeKernels.decoder_layers`): the Python
    and dispatch between a layer's dozen ops cost as much as its attention at decode sizes;
    decodes attend through the decode kernel, prompt chunks the prefill kernel. In a model,
    `NativeLlamaModel` runs all such layers in one call and reads their `weights`. Holds the
    layer's own modules (the fallback for other attention backends), so parameter names and
    state dicts are unchanged."""

    def __init__(
        self, layer: LlamaDecoderLayer, weights: DecoderLayerWeights, kernels: NativeKernels
    ) -> None:
        nn.Module.__init__(self)  # adopts the layer's modules instead of building new ones
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.weights = weights
        self.kernels = kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not isinstance(get_forward_context().attn_backend, NativeAttentionBackend):
            return super().forward(x, cos, sin)
        return _run_native_layers(
            self.kernels, [self.weights], [self.self_attn.attn.layer_idx], x, cos, sin
        )


class NativeLlamaModel(LlamaModel):
    """A decoder stack whose layers are all `NativeDecoderLayer`s, run as one native call
    (`decoder_layers`) for every step: called layer by layer, the Python between them ran on
    caches each layer's weights had just flushed, about 90 us a layer. Holds the model's own
    modules, so parameter names and state dicts are unchanged."""

    def __init__(self, model: LlamaModel, kernels: NativeKernels) -> None:
        nn.Module.__init__(self)  # adopts the model's modules instead of building new ones
        self.embed_tokens = model.embed_tokens
        self.layers = model.layers
        self.norm = model.norm
        self.rotary_emb = model.rotary_emb
        self.kernels = kernels
        # Read once: the layers are not replaced after the swap.
        layers: list[NativeDecoderLayer] = list(model.layers)  # type: ignore[arg-type]
        self.layer_weights = [layer.weights for layer in layers]
        self.cache_indices = [layer.self_attn.attn.layer_idx for layer in layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(get_forward_context().attn_backend, NativeAttentionBackend):
            return super().forward(input_ids, positions)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_cos_sin(positions, x.dtype)
        x = _run_native_layers(self.kernels, self.layer_weights, self.cache_indices, x, cos, sin)
        return self.norm(x)


def _run_native_layers(
    kernels: NativeKernels,
    weights: list[DecoderLayerWeights],
    cache_indices: list[int],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The layers of `weights` over the current step, each with the step's KV cache of the
    matching index."""
    ctx = get_forward_context()
    metadata = ctx.attn_metadata
    return kernels.decoder_layers(
        weights,
        x,
        cos,
        sin,
        [ctx.kv_caches[i] for i in cache_indices],
        metadata.slot_mapping,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.num_decodes,
    )


def _decoder_layer_weights(layer: LlamaDecoderLayer) -> DecoderLayerWeights | None:
    """The native weights of a decoder layer whose parts are all native twins, else None."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, LlamaMLP):  # a mixture of experts: its modules run one by one
        return None
    linears = {name: getattr(attn, f"{name}_proj") for name in ("q", "k", "v", "o")}
    linears |= {name: getattr(mlp, f"{name}_proj") for name in ("gate", "up", "down")}
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if (attn.q_norm is None) != (attn.k_norm is None):
        return None
    qk_norms = [attn.q_norm, attn.k_norm] if attn.q_norm is not None and attn.k_norm else []
    native = (
        all(isinstance(m, PackedLinear) for m in linears.values())
        and all(isinstance(m, NativeRMSNorm) for m in norms + qk_norms)
        and isinstance(attn.rotary, NativeApplyRotary)
        and isinstance(mlp.act_fn, NativeSiluAndMul)
        and len({m.eps for m in norms + qk_norms}) == 1
        and attn.head_dim % (2 * STRIP) == 0
        and attn.rotary_dim == attn.head_dim  # the kernel rotates whole heads
    )
    if not native:
        return None
    tensors: dict[str, PackedWeight | None] = {
        "input_norm": layer.input_layernorm.weight,
        "post_norm": layer.post_attention_layernorm.weight,
        "q_norm": qk_norms[0].weight if qk_norms else None,
        "k_norm": qk_norms[1].weight if qk_norms else None,
    }
    for name, linear in linears.items():
        tensors[name] = linear.weight_form
        tensors[f"{name}_bias"] = linear.bias
    return DecoderLayerWeights.build(
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        eps=layer.input_layernorm.eps,
        scale=attn.attn.scale,
        tensors=tensors,
        window=attn.attn.window,
        softcap=attn.attn.softcap,
    )


class WeightCoder:
    """code_weight with a memory: codes found at an earlier start (`known`, by linear name)
    are taken where their shapes fit, and what is found now is kept in `found`."""

    def __init__(
        self, kernels: NativeKernels, known: Mapping[str, CodedWeight | None] | None = None
    ) -> None:
        self.kernels = kernels
        self.known = dict(known or {})
        self.found: dict[str, CodedWeight | None] = {}

    def for_linear(self, name: str) -> Coder:
        def find(weight: torch.Tensor) -> CodedWeight | None:
            if name in self.known:
                kept = self.known[name]
                if kept is None or codes_cache.fits(kept, weight):
                    return kept
            coded = code_weight(weight, self.kernels.code_runs)
            self.found[name] = coded
            return coded

        return find


def _native_twin(
    module: nn.Module, kernels: NativeKernels, *, code: str, amx: bool, coder: Coder | None = None
) -> nn.Module | None:
    """The native replacement of one module, or None to keep it."""
    if type(module) is nn.Linear:  # not subclasses, which may read .weight themselves
        fits = module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
        fits = fits and module.out_features % STRIP == 0
        return PackedLinear(module, kernels, code=code, amx=amx, coder=coder) if fits else None
    if type(module) is RMSNorm:
        fits = module.weight.dtype == torch.float32 and module.weight.shape[0] % STRIP == 0
        return NativeRMSNorm(module, kernels) if fits else None
    if type(module) is SiluAndMul:
        return NativeSiluAndMul(kernels)
    if type(module) is ApplyRotary:
        return NativeApplyRotary(kernels)
    return None


def use_native_kernels(
    model: nn.Module,
    kernels: NativeKernels,
    *,
    weight_format: str = "auto",
    amx: bool = False,
    coder: WeightCoder | None = None,
) -> int:
    """Swap the model's modules for their native twins in place; returns how many were swapped.
    The model must be float32 on the CPU. An embedding tied to a linear that gets packed reads
    the packed weight, so tied weights stay one tensor. `weight_format` ("auto", "coded" or
    "float32", see ModelConfig.cpu_weight_format): whether linears whose weights are exact byte
    codes (packed_weights.py) hold them too, or only them, except the LM head and weights tied
    to an embedding, which the greedy head and the lookups read as floats. `amx`: coded
    weights read on AMX in steps of many rows where the CPU has it (see PackedLinear).
    `coder`: the codes of an earlier start, by module name (see codes_cache.py)."""
    names = {id(module): name for name, module in model.named_modules()} if coder else {}
    packed_by_weight: dict[int, nn.Parameter] = {}
    embeddings: list[tuple[nn.Module, str, nn.Embedding]] = []
    float_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, nn.Linear):
        float_weights.add(id(lm_head.weight))
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding):
                embeddings.append((parent, name, child))
            tied = id(getattr(child, "weight", None)) in float_weights
            code = "float32" if tied else weight_format
            find = coder.for_linear(names[id(child)]) if coder and id(child) in names else None
            twin = _native_twin(child, kernels, code=code, amx=amx, coder=find)
            if twin is not None:
                if isinstance(twin, PackedLinear) and twin.packed is not None:
                    packed_by_weight[id(child.weight)] = twin.packed
                setattr(parent, name, twin)
                swapped += 1
    for parent, name, embedding in embeddings:
        packed = packed_by_weight.get(id(embedding.weight))
        if packed is not None:
            setattr(parent, name, PackedEmbedding(embedding, packed))
            swapped += 1
    for mlp in model.modules():  # a layer's gate and up run as one pass, from one form
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if (
            isinstance(gate, PackedLinear)
            and isinstance(up, PackedLinear)
            and (gate.codes is None) != (up.codes is None)
        ):
            (up if gate.codes is None else gate).drop_codes()
    head = getattr(model, "lm_head", None)
    if isinstance(head, PackedLinear) and head.packed is not None and head.bias is None:
        head.greedy = GreedyHead.build(head.packed, kernels)
        if head.greedy is not None:
            logger.info(
                "Greedy requests take the LM head's exact argmax through a bfloat16 screen "
                "(%.3f GiB besides the weights)",
                head.greedy.nbytes / 2**30,
            )
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, LlamaDecoderLayer) or isinstance(child, NativeDecoderLayer):
                continue
            weights = _decoder_layer_weights(child)
            if weights is not None:
                setattr(parent, name, NativeDecoderLayer(child, weights, kernels))
                swapped += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                type(child) is LlamaModel
                and len(child.layers) > 0
                and all(isinstance(layer, NativeDecoderLayer) for layer in child.layers)
            ):
                setattr(parent, name, NativeLlamaModel(child, kernels))
                swapped += 1
    _log_coded(model, weight_format)
    return swapped


def _log_coded(model: nn.Module, weight_format: str) -> None:
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    coded = [m.weight_form for m in linears if m.codes is not None]
    if coded:
        parts = [m.parts for m in linears if m.parts is not None]
        if parts:
            reads = (
                "steps of few rows read them on the FMA units, longer steps on AMX, steps of "
                f"128 rows or more bfloat16 weight parts of {len(parts)} of them "
                f"({sum(p.nbytes for p in parts) / 2**30:.3f} GiB)"
            )
        elif any(m.amx for m in linears):
            reads = "steps of few rows read them on the FMA units, longer steps on AMX"
        elif weight_format == "auto":
            reads = "steps of few rows read them, longer steps their float32 strips"
        else:
            reads = "every step reads them"
        logger.info(
            "%d of %d linear weights are exact byte codes (%.3f GiB); %s (--cpu-weight-format %s)",
            len(coded),
            len(linears),
            sum(w.nbytes for w in coded) / 2**30,
            reads,
            weight_format,
        )
