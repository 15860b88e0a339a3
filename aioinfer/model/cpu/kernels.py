"""Build and load the native CPU kernels (kernels.c) with the system C compiler and ctypes.

The shared library is compiled once per source, compiler, flags and CPU into the aioinfer cache
(`$AIOINFER_CACHE/kernels/`, a folder made 0700), written atomically, and reused by later starts.
Loading a library runs its code, and its name is predictable: a cached one is loaded only when
the file, opened without following links, and every folder above it belong to this user (or
root, above the kernels folder) and no one else may write them (a sticky folder such as /tmp
aside); the opened file is what loads (/proc/self/fd/N), not the path again. Otherwise the
kernels are built into a private folder of this process. `load()` returns None, with the reason
in `unavailable_reason()`, on CPUs with neither AVX-512F nor AVX2 + FMA, without a C compiler,
when the build fails, or when the library does not load (a WARNING then): callers then keep
torch's ops.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aioinfer.model.cpu.packed_weights import (
    CODE_BLOCK,
    STRIP,
    CodedWeight,
    PackedWeight,
    WeightStruct,
    check_float32,
    packed_shape,
    parts_shape,
    weight_struct,
)
from aioinfer.model.loader.gguf_cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# The instruction set to compile for: the build machine's own by default. Setting
# AIOINFER_CPU_MARCH=haswell builds the AVX2 + FMA variant (tests run both where they can).
MARCH_ENV = "AIOINFER_CPU_MARCH"
BUILD_TIMEOUT_S = 120
_MASK64 = (1 << 64) - 1

_c_float_p = ctypes.c_void_p


class NativeKernels:
    """The loaded library, with one typed Python wrapper per kernel."""

    def __init__(self, path: Path, fd: int | None = None) -> None:
        """The library at `path`, or the file open as `fd` (named `path`), which then stays
        open: dlopen knows a library by its name, and a number reused would name another."""
        self.path = path
        self._fd = fd
        lib = ctypes.CDLL(str(path) if fd is None else f"/proc/self/fd/{fd}")
        # Argument types, in each C signature's order: P float buffer, V index buffer, L long,
        # I int, F float, W the layer's weights (DecoderLayerWeights).
        P, L, I, F = _c_float_p, ctypes.c_long, ctypes.c_int, ctypes.c_float  # noqa: E741
        V, W = ctypes.c_void_p, ctypes.POINTER(DecoderLayerWeights)
        self._packed_linear = _bind(lib.packed_linear, P, L, L, V, L, P, P, I, I)
        self._paged_decode = _bind(
            lib.paged_decode_attention, P, P, P, L, P, L, L, L, L, L, L, F, F, P, I
        )
        self._paged_prefill = _bind(
            lib.paged_prefill_attention, P, P, V, L, V, V, L, L, L, L, L, L, L, F, F, P, I
        )
        self._rms_norm = _bind(lib.rms_norm, P, L, L, P, F, P, I)
        self._silu_mul = _bind(lib.silu_mul, P, P, L, P, I)
        self._rotary = _bind(lib.rotary, P, L, L, L, P, P, P, I)
        self._top_p_thresholds = _bind(lib.top_p_thresholds, P, L, L, P, P, I)
        self._race_argmax = _bind(lib.race_argmax, P, L, L, V, V, I)
        self._apply_token_bitmask = _bind(lib.apply_token_bitmask, P, L, V, L, V, L, I)
        self._decoder_layers = _bind(
            lib.decoder_layers, V, V, L, P, L, P, P, V, V, L, V, V, L, L, L, P, I
        )
        self._decoder_layer_work = _bind(lib.decoder_layer_work_floats, W, L, restype=L)
        self._code_runs = _bind(lib.code_runs, P, L, P, P, V, V, I)
        self._weight_parts = _bind(lib.weight_parts, V, P, L, L, V, I, restype=I)
        # The exact greedy LM head (model/cpu/greedy_head.py) needs AVX512-BF16.
        self.has_greedy_head = bool(_bind(lib.greedy_head_available, restype=I)())
        if self.has_greedy_head:
            self.greedy_head = _bind(
                lib.greedy_head, P, L, L, V, P, P, ctypes.c_double, L, L, P, V, V, I, restype=I
            )
        self.has_amx = bool(_bind(lib.amx_available, restype=I)())  # CPU, build and OS allow
        # Scratch of decoder_layers, grown to the largest step and reused; one per thread, as
        # the kernels are shared by every engine of the process, each with its own thread.
        self._scratch = threading.local()

    def packed_linear(
        self, x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] contiguous float32 @ W^T + bias -> [M, N]; W packed by `pack_weight`, or
        coded by `code_weight`."""
        check_float32(x)
        m, k = x.shape
        weight = weight_struct(packed)
        n, in_features = packed_shape(packed)
        if k != in_features:
            raise ValueError(f"x must have {in_features} columns, got {k}")
        out = torch.empty(m, n, dtype=torch.float32)
        if m > 0:
            self._packed_linear(
                x.data_ptr(),
                m,
                k,
                ctypes.byref(weight),
                n,
                None if bias is None else bias.data_ptr(),
                out.data_ptr(),
                0,  # overwrite out, do not accumulate into it
                torch.get_num_threads(),
            )
        return out

    def code_runs(
        self, runs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [R, 32] (int8) of runs [R, 32] (float32) under scale and offset [R], and
        whether each run's codes rebuild it bit for bit ([R], bool); see packed_weights."""
        runs, scale, offset = runs.contiguous(), scale.contiguous(), offset.contiguous()
        check_float32(runs, scale, offset)
        count = runs.shape[0]
        if tuple(runs.shape) != (count, CODE_BLOCK) or {scale.shape, offset.shape} != {(count,)}:
            raise ValueError(f"runs must be [R, {CODE_BLOCK}] with scale and offset [R]")
        codes = torch.empty(count, CODE_BLOCK, dtype=torch.int8)
        fits = torch.empty(count, dtype=torch.bool)
        self._code_runs(
            runs.data_ptr(), count, scale.data_ptr(), offset.data_ptr(), codes.data_ptr(),
            fits.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return codes, fits

    def weight_parts(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
        """A coded weight's parts for AMX linears (packed_weights.parts_shape), or None where
        some weight does not split into two bfloat16s."""
        weight_struct(CodedWeight(codes, scales))  # checks the layout the kernel reads
        strips, k, _ = codes.shape
        parts = torch.empty(parts_shape(strips, k), dtype=torch.int16)
        fits = self._weight_parts(codes.data_ptr(), scales.data_ptr(), strips, k,
                                  parts.data_ptr(), torch.get_num_threads())  # fmt: skip
        return parts if fits else None

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """query [B, H, D] over seq_lens[b] tokens of kv_cache [N, 2, block_size, KV, D] through
        block_tables [B, W] (int32) -> [B, H, D]; with a sliding `window`, over the last `window`
        tokens only; with a `softcap`, scores become softcap * tanh(score / softcap). All
        float32; D a multiple of 16."""
        b, h, d = query.shape
        query = query.contiguous()
        check_float32(query, kv_cache)
        block_tables = block_tables.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty_like(query)
        self._paged_decode(
            query.data_ptr(),
            kv_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            seq_lens.data_ptr(),
            b,
            h,
            kv_cache.shape[3],
            d,
            kv_cache.shape[2],
            window,
            scale,
            softcap,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def paged_prefill_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """query [T, H, D] of R requests' chunks, request r's tokens at query_start_loc[r] ..
        query_start_loc[r + 1] ([R + 1], int32, ending at T), each attending causally over its
        seq_lens[r] ([R], int32) tokens of context (with a sliding `window`, its last `window`
        tokens), the chunk's own K/V included, read from kv_cache [N, 2, block_size, KV, D]
        through block_tables [R, W] (int32) -> [T, H, D]; `softcap` as paged_decode_attention."""
        t, h, d = query.shape
        query = query.contiguous()
        check_float32(query, kv_cache)
        _check_requests(t, block_tables, query_start_loc, seq_lens)
        out = torch.empty_like(query)
        self._paged_prefill(
            query.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            query_start_loc.data_ptr(), seq_lens.data_ptr(), 0, seq_lens.shape[0], h,
            kv_cache.shape[3], d, kv_cache.shape[2], window, scale, softcap, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim (a multiple of 16) of float32 x; weight [dim]."""
        x = x.contiguous()
        check_float32(x, weight)
        dim = x.shape[-1]
        out = torch.empty_like(x)
        rows = x.numel() // dim
        self._rms_norm(
            x.data_ptr(), rows, dim, weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads()
        )
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for float32 tensors of one shape, in place in gate's buffer when
        gate is contiguous (as torch's SiluAndMul: at prefill sizes it is the largest
        activation)."""
        up = up.contiguous()
        out = gate if gate.is_contiguous() else gate.contiguous()
        check_float32(out, up)
        self._silu_mul(
            out.data_ptr(), up.data_ptr(), out.numel(), out.data_ptr(), torch.get_num_threads()
        )
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rotary` for float32 x [T, heads, D] (D a multiple of 32), cos/sin [T, D / 2]."""
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        check_float32(x, cos, sin)
        tokens, heads, dim = x.shape
        out = torch.empty_like(x)
        self._rotary(
            x.data_ptr(), tokens, heads, dim, cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def top_p_thresholds(self, logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """For logits [B, V] (-inf where already removed) and top_p [B, 1], the threshold
        [B, 1] of each row's nucleus: its tokens are those with logits >= the threshold, as
        the smallest prefix of the descending sort that reaches top_p, ties included (-inf where
        top_p >= 1). Float32 on the CPU."""
        logits = logits.contiguous()
        top_p = top_p.to(torch.float32).reshape(-1).contiguous()
        check_float32(logits, top_p)
        rows, vocab = logits.shape
        if top_p.shape[0] != rows:
            raise ValueError(f"top_p must have {rows} rows, got {top_p.shape[0]}")
        out = torch.empty(rows, 1)
        self._top_p_thresholds(
            logits.data_ptr(), rows, vocab, top_p.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def race_argmax(self, logits: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
        """A draw from softmax(logits [B, V]) per row (float32, temperature applied, -inf where
        removed): the exponential race with noise hashed from keys[r] (64 bits) and each
        token's index, so a row's draw depends on its key and logits only. -> [B] int64."""
        logits = logits.contiguous()
        check_float32(logits)
        rows, vocab = logits.shape
        if len(keys) != rows:
            raise ValueError(f"need one key per row: {rows} rows, {len(keys)} keys")
        # Each key mod 2^64 as int64 (two's complement), read back as unsigned by the kernel.
        signed = [((k + (1 << 63)) & _MASK64) - (1 << 63) for k in keys]
        key_tensor = torch.tensor(signed, dtype=torch.int64)
        out = torch.empty(rows, dtype=torch.int64)
        self._race_argmax(
            logits.data_ptr(), rows, vocab, key_tensor.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def apply_token_bitmask(
        self, logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor
    ) -> None:
        """In place: -inf in row rows[r] of logits [B, V] (float32) at each token that the
        int32 bitmask masks[r] ([R, ceil(V / 32)]) leaves out."""
        check_float32(logits)
        _check_indices(rows, torch.int64)
        masks = masks.contiguous()
        batch, vocab = logits.shape
        words = (vocab + 31) // 32
        if masks.dtype != torch.int32 or masks.shape != (rows.shape[0], words):
            raise ValueError(f"masks must be int32 [{rows.shape[0]}, {words}], got {masks.shape}")
        if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < batch:
            raise ValueError(f"rows must be in [0, {batch})")
        self._apply_token_bitmask(
            logits.data_ptr(), vocab, rows.data_ptr(), rows.shape[0], masks.data_ptr(), words,
            torch.get_num_threads(),
        )  # fmt: skip

    def decoder_layers(
        self,
        layers: Sequence[DecoderLayerWeights],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        num_decodes: int,
    ) -> torch.Tensor:
        """Decoder layers in turn over the B tokens of a step's R requests, layer i with its
        cache kv_caches[i] [N, 2, block_size, KV, D]: x [B, hidden] -> [B, hidden]. Each layer
        writes the tokens' K/V at slot_mapping [B] (int64) of its cache, then request r's tokens
        (query_start_loc[r] .. query_start_loc[r + 1], [R + 1] int32) attend causally through
        block_tables[r] [W] over seq_lens[r] ([R], int32) tokens of context, their own
        included; the first num_decodes requests have one token each. cos/sin [B, D / 2] as
        `rotary` takes them. All layers must share their sizes and the caches their shape."""
        if not layers or len(layers) != len(kv_caches):
            raise ValueError(
                f"need one KV cache per layer and at least one layer, got {len(layers)} layers "
                f"and {len(kv_caches)} caches"
            )
        out = x.clone(memory_format=torch.contiguous_format)  # updated in place by the kernel
        cos, sin = cos.contiguous(), sin.contiguous()
        check_float32(out, cos, sin, *kv_caches)
        _check_indices(slot_mapping, torch.int64)
        b = out.shape[0]
        _check_requests(b, block_tables, query_start_loc, seq_lens)
        num_reqs = seq_lens.shape[0]
        if not 0 <= num_decodes <= min(num_reqs, b):
            raise ValueError(f"num_decodes must be in [0, {min(num_reqs, b)}], got {num_decodes}")
        if not all(isinstance(layer, DecoderLayerWeights) for layer in layers):
            raise TypeError("layers must be DecoderLayerWeights")  # passed as raw addresses
        first = layers[0]
        sizes = ("hidden", "heads", "kv_heads", "head_dim", "intermediate")
        if any(getattr(layer, n) != getattr(first, n) for layer in layers for n in sizes):
            raise ValueError("decoder layers of one call must share their sizes")
        cache_shape = tuple(kv_caches[0].shape)
        expected = {
            "x": (out.shape, (b, first.hidden)),
            "cos": (cos.shape, (b, first.head_dim // 2)),
            "sin": (sin.shape, (b, first.head_dim // 2)),
            "kv_cache": (cache_shape[1:2] + cache_shape[3:], (2, first.kv_heads, first.head_dim)),
            "slot_mapping": (slot_mapping.shape, (b,)),
            **{f"kv_caches[{i}]": (c.shape, cache_shape) for i, c in enumerate(kv_caches)},
        }
        for name, (got, want) in expected.items():
            if tuple(got) != want:  # the kernel would read past them
                raise ValueError(f"{name} must have shape {want}, got {tuple(got)}")
        # The most any layer needs: AMX linears add scratch, and layer 0 may have none.
        floats = max(self._decoder_layer_work(ctypes.byref(w), b) for w in layers)
        work = getattr(self._scratch, "work", None)
        if work is None or work.numel() < floats:
            work = self._scratch.work = torch.empty(floats)
        layer_ptrs = (ctypes.c_void_p * len(layers))(*(ctypes.addressof(n) for n in layers))
        cache_ptrs = (ctypes.c_void_p * len(layers))(*(c.data_ptr() for c in kv_caches))
        self._decoder_layers(
            layer_ptrs, cache_ptrs, len(layers), out.data_ptr(), b, cos.data_ptr(),
            sin.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], query_start_loc.data_ptr(), seq_lens.data_ptr(), num_reqs,
            num_decodes, cache_shape[2], work.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


# The C struct DecoderLayer's tensors, after its sizes; a None tensor is passed as NULL.
_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
_LAYER_TENSORS = (
    "input_norm", "post_norm", "q_norm", "k_norm", *_LINEARS,
    "q_bias", "k_bias", "v_bias", "o_bias", "gate_bias", "up_bias", "down_bias",
)  # fmt: skip


class DecoderLayerWeights(ctypes.Structure):
    """The weights of one decoder layer as the C `DecoderLayer` holds them: norms [hidden]
    (q_norm and k_norm [head_dim], or both None), linear weights packed by `pack_weight` or
    coded by `code_weight`, biases [out_features] or None. Holds raw pointers, and the tensors
    to keep them alive: the tensors must keep their storage (load into them in place, never
    replace them)."""

    _fields_ = [
        ("hidden", ctypes.c_long), ("heads", ctypes.c_long), ("kv_heads", ctypes.c_long),
        ("head_dim", ctypes.c_long), ("intermediate", ctypes.c_long), ("window", ctypes.c_long),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        *((name, WeightStruct if name in _LINEARS else ctypes.c_void_p) for name in _LAYER_TENSORS),
    ]  # fmt: skip

    @classmethod
    def build(
        cls,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        tensors: dict[str, PackedWeight | None],
        window: int = 0,
        softcap: float = 0.0,
    ) -> DecoderLayerWeights:
        if set(tensors) != set(_LAYER_TENSORS):
            raise ValueError(f"tensors must name exactly {_LAYER_TENSORS}, got {sorted(tensors)}")
        linears = {name: tensors[name] for name in _LINEARS}
        if any(w is None for w in linears.values()):
            raise ValueError(f"every linear weight must be given: {_LINEARS}")
        plain = {name: t for name, t in tensors.items() if name not in _LINEARS}
        if any(isinstance(t, CodedWeight) for t in plain.values()):
            raise ValueError("only linear weights may be coded")
        hidden = plain["input_norm"].shape[0]  # type: ignore[union-attr]
        intermediate = packed_shape(linears["gate"])[0]  # type: ignore[arg-type]
        widths = (hidden, heads * head_dim, kv_heads * head_dim, intermediate)
        if head_dim % (2 * STRIP) or any(w % STRIP for w in widths):
            raise ValueError(
                f"head_dim must be a multiple of {2 * STRIP} and every width of {STRIP}, got "
                f"head_dim {head_dim}, widths {widths}"
            )
        if (plain["q_norm"] is None) != (plain["k_norm"] is None):
            raise ValueError("q_norm and k_norm must be given together")
        if _form(linears["gate"]) != _form(linears["up"]):  # type: ignore[arg-type]
            raise ValueError("gate and up must be packed alike (the kernel runs them as one)")
        # The kernel reads raw memory at these sizes: any other shape would be misread.
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        packed = {"q": (q_out, hidden), "k": (kv_out, hidden), "v": (kv_out, hidden),
                  "o": (hidden, q_out), "gate": (intermediate, hidden),
                  "up": (intermediate, hidden), "down": (hidden, intermediate)}  # fmt: skip
        for name, weight in linears.items():
            got = packed_shape(weight)  # type: ignore[arg-type]
            if got != packed[name]:
                raise ValueError(f"{name} must have shape {packed[name]} unpacked, got {got}")
        shapes: dict[str, tuple[int, ...]] = {
            "input_norm": (hidden,), "post_norm": (hidden,), "q_norm": (head_dim,),
            "k_norm": (head_dim,), **{f"{name}_bias": (n,) for name, (n, _) in packed.items()},
        }  # fmt: skip
        for name, t in plain.items():
            if t is not None:
                check_float32(t)  # type: ignore[arg-type]
                if tuple(t.shape) != shapes[name]:  # type: ignore[union-attr]
                    raise ValueError(f"{name} must have shape {shapes[name]}, got {tuple(t.shape)}")  # type: ignore[union-attr]
        fields = (
            weight_struct(tensors[n]) if n in _LINEARS  # type: ignore[arg-type]
            else None if tensors[n] is None else tensors[n].data_ptr()  # type: ignore[union-attr]
            for n in _LAYER_TENSORS
        )  # fmt: skip
        layer = cls(
            hidden, heads, kv_heads, head_dim, intermediate, window, eps, scale, softcap, *fields
        )
        layer.tensors = tensors  # keeps the pointed-to storage alive
        return layer


def _form(weight: PackedWeight) -> tuple[bool, bool]:
    """(has strips, has codes); parts may differ (the kernel runs a gated pass from parts only
    where both have them)."""
    if isinstance(weight, CodedWeight):
        return weight.strips is not None, True
    return True, False


def _bind(function: Any, *argtypes: Any, restype: Any = None) -> Any:
    """A C function of the library with its argument and result types declared."""
    function.argtypes = list(argtypes)
    function.restype = restype
    return function


def _check_requests(
    num_tokens: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Refuse a step's per-request index tensors unless they are contiguous int32 on the CPU
    with shapes that agree with each other and the step's token count (the kernels trust their
    values). Called once a step: checks only, no conversions."""
    for t in (block_tables, query_start_loc, seq_lens):
        _check_indices(t, torch.int32)
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    expected = {
        "seq_lens": (seq_lens.shape, (num_reqs,)),
        "block_tables": (block_tables.shape[:1] if block_tables.dim() == 2 else (), (num_reqs,)),
        "query_start_loc": (query_start_loc.shape, (num_reqs + 1,)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:  # the kernels would read past them
            raise ValueError(f"{name} must have shape {want}, got {tuple(got)}")
    if int(query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc must end at the step's {num_tokens} tokens, "
            f"got {int(query_start_loc[-1])}"
        )


def _check_indices(t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"native CPU kernels take contiguous {dtype} CPU index tensors, got {t.dtype} on "
            f"{t.device}, contiguous={t.is_contiguous()}"
        )


def compiler_flags(march: str) -> list[str]:
    flags = ["-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-lm"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # GCC defaults to 256-bit even with AVX-512
    return flags


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def amx_expected() -> bool:
    """Whether `load()`'s kernels would have AMX, from the CPU's flags (for memory plans)."""
    needed = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    return _march(None) == "native" and needed <= set(_cpu_flags().split())


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


@functools.cache
def _load(march: str) -> tuple[NativeKernels | None, str]:
    recipe = _recipe(march)
    if isinstance(recipe, str):
        return None, recipe
    cc, cflags, name = recipe
    try:
        try:
            return _load_cached(cc, cflags, cache_root() / "kernels", name), ""
        except _Untrusted as exc:
            logger.warning(
                "Not loading the cached CPU kernels: %s; building them for this process alone", exc
            )
        return _load_private(cc, cflags, name), ""
    except _LoadError as exc:
        logger.warning("The native CPU kernels do not load (%s); using torch ops", exc)
        return None, str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return None, f"building {SOURCE.name} failed: {detail.strip()[:500]}"


def _recipe(march: str) -> tuple[str, list[str], str] | str:
    """The compiler, its flags and the library's file name (a digest of the source, the
    compiler, the flags and the CPU); or why this machine has no native kernels."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no native kernels for {platform.machine()}"
    flags = _cpu_flags().split()
    if "avx512f" not in flags and not {"avx2", "fma"} <= set(flags):
        return "the CPU has neither AVX-512F nor AVX2 with FMA"
    cc = _compiler()
    if cc is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')!r}) on PATH"
    cflags = compiler_flags(march)
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        return f"cannot read {SOURCE}: {exc}"
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(cflags).encode(),
                                      " ".join(flags).encode()]))  # fmt: skip
    return cc, cflags, f"cpu-{key.hexdigest()[:16]}.so"


class _Untrusted(Exception):
    """A cached library, or a folder above it, that another user could have written."""


class _LoadError(Exception):
    """A library that does not load, or lacks a kernel."""


def cached_library(march: str | None = None) -> Path | None:
    """Where `load()` looks for its library in the cache (None where it would not)."""
    recipe = _recipe(_march(march))
    return None if isinstance(recipe, str) else cache_root() / "kernels" / recipe[2]


def _load_cached(cc: str, cflags: list[str], folder: Path, name: str) -> NativeKernels:
    """The cached library, built first where missing; _Untrusted where it, or a folder on its
    path, is not this user's alone."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        real = Path(os.path.realpath(folder))
    except OSError as exc:  # a cache this user cannot write (another user's, read-only)
        raise _Untrusted(f"cannot make {folder}: {exc.strerror or exc}") from None
    _check_folders_above(real)
    fd = _open_owned(real, name)
    if fd is None:
        _build(cc, cflags, real / name)
        fd = _open_owned(real, name)
        if fd is None:
            raise _Untrusted(f"{real / name} was removed as it was built")
    return _loaded(real / name, fd)


def _load_private(cc: str, cflags: list[str], name: str) -> NativeKernels:
    """A build of this process's own, in a folder that only it knows and that is removed once
    the library is open."""
    private = Path(tempfile.mkdtemp(prefix="aioinfer-kernels-"))
    try:
        _build(cc, cflags, private / name)
        fd = _open_owned(private, name)
        assert fd is not None
        return _loaded(private / name, fd)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _loaded(path: Path, fd: int) -> NativeKernels:
    try:
        return NativeKernels(path, fd)
    except OSError as exc:  # dlopen refused it: nothing is known by the fd's name
        os.close(fd)
        raise _LoadError(f"loading {path} failed: {exc}") from None
    except AttributeError as exc:  # a kernel the library lacks
        # It stays loaded under the name /proc/self/fd/<fd>: the fd stays open, so that a
        # later library opened under the same number is not taken for this one.
        raise _LoadError(f"loading {path} failed: {exc}") from None


def _check_folders_above(folder: Path) -> None:
    """Each folder above `folder` (a real path) is this user's or root's, and no one else may
    write it unless it is sticky (as /tmp, where others cannot rename this user's entries)."""
    euid = os.geteuid()
    for above in folder.parents:
        st = os.lstat(above)
        if st.st_uid not in (euid, 0):
            raise _Untrusted(f"{above} belongs to uid {st.st_uid}")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _Untrusted(f"{above} may be written by others (mode {st.st_mode & 0o7777:o})")


def _check_owned(st: os.stat_result, what: Path) -> None:
    if st.st_uid != os.geteuid():
        raise _Untrusted(f"{what} belongs to uid {st.st_uid}")
    if st.st_mode & 0o022:
        raise _Untrusted(f"{what} may be written by others (mode {st.st_mode & 0o7777:o})")


def _open_owned(folder: Path, name: str) -> int | None:
    """`folder`/`name` opened (without following a link) when both are this user's and no one
    else may write them; None when there is no such file."""
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_owned(os.fstat(dir_fd), folder)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Untrusted(f"{folder / name} is a symbolic link") from None
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted(f"{folder / name} is not a regular file")
        _check_owned(st, folder / name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _build(cc: str, cflags: list[str], target: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *cflags, "-o", tmp, str(SOURCE)],
            check=True,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.chmod(tmp, 0o700)  # the compiler's umask may let others write it
        os.replace(tmp, target)  # atomic: concurrent starts never load a half-written file
        logger.debug("built %s", target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(march: str | None = None) -> NativeKernels | None:
    """The native kernels, or None when this machine cannot build or run them. `march`
    overrides $AIOINFER_CPU_MARCH (default "native")."""
    return _load(_march(march))[0]


def unavailable_reason(march: str | None = None) -> str:
    """Why `load()` returned None ("" when it did not)."""
    return _load(_march(march))[1]


def _march(march: str | None) -> str:
    return march or os.environ.get(MARCH_ENV) or "native"
