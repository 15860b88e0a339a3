"""Batched sampling: `prepare` on the host once per step, `sample` on the device with no host sync.

`Sampler.prepare` turns the step's sampling chunks into a `SamplingBatch` of device tensors (one
`torch.tensor` per field from Python lists; no per-token loops). `Sampler.sample` takes the logits
of those chunks, one row each and in the same order, and returns a `SamplerOutput` whose tensors
stay on the device until `SamplerOutput.to_host` copies them: the one sync point.

Semantics are vLLM's. Logprobs describe the raw model distribution (log_softmax of the logits as
given), and a rank is the number of tokens at least as likely as the chosen one (1 = the best).
The logits go through, in order:

    logit_bias (added) -> banned ids and tokens outside the allowed mask (-inf; bitmasks of
    allowed_token_ids and grammars, see core/constraints.py) -> repetition penalty (HF: over
    prompt + output, positive logits divided, negative multiplied) -> frequency / presence
    penalties (OpenAI: over output only, logit -= freq * count + presence * (count > 0)) ->
    [greedy rows: argmax here]
    -> temperature -> min_p -> top_k -> top_p -> exponential race (argmax of probs / Exp(1))

Truncation keeps ties: top_k keeps every token whose logit is >= the k-th largest one; top_p keeps
the most likely tokens up to and including the first at which the cumulative probability reaches
top_p, plus every token tied with that last one; min_p keeps tokens with prob >= min_p * max prob.
Removed tokens get logit -inf, hence probability exactly 0, and can never win the race.

Seeded rows reproduce whatever batch they are in: each one draws its noise from a generator reseeded
with `seeded_generator_seed(seed, output_index)` every step (the native CPU race hashes its noise
from that value), so the draw depends on nothing else. Unseeded rows share one generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from aioinfer.core.constraints import bans_within
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import ScheduledChunk, TokenLogprobs
from aioinfer.gpu.token_masks import apply_token_masks

if TYPE_CHECKING:
    from aioinfer.model.cpu.kernels import NativeKernels

MAX_LOGPROBS = 20
# (logits [B, V], top_p [B, 1]) -> threshold [B, 1]: the nucleus is the logits >= it.
TopPThresholds = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
# Rows of prompt logits turned into logprobs at a time; bounds the extra [rows, V] buffers.
PROMPT_LOGPROBS_ROWS = 512


def seeded_generator_seed(seed: int, output_index: int) -> int:
    """The generator seed of a seeded request's `output_index`-th token.

    It is output number `output_index` of a SplitMix64 stream started at `seed mod 2**64`: a fixed
    function of (seed, output_index), spread over all 64 bits so nearby seeds and indices give
    unrelated noise.
    """
    z = ((seed & _MASK64) + (output_index + 1) * _GOLDEN64) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def validate_sampling_params(
    params: SamplingParams, vocab_size: int, max_logprobs: int = MAX_LOGPROBS
) -> None:
    """Raise ValueError naming the field when `params` ask for what this vocabulary cannot give."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(f"{name} must be <= {max_logprobs}, got {value}")
    bad = [t for t in (params.logit_bias or {}) if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids must be < {vocab_size} (the vocabulary), got {bad}")


@dataclass(frozen=True, slots=True)
class TokenEntries:
    """Entries (rows[i], cols[i]) of a [B, V] matrix, with a value each where one is needed."""

    rows: torch.Tensor  # [E] int64
    cols: torch.Tensor  # [E] int64


@dataclass(frozen=True, slots=True)
class TokenBias(TokenEntries):
    values: torch.Tensor  # [E] float32


@dataclass(frozen=True, slots=True)
class AllowedMasks:
    """The rows that may sample only some tokens, and their int32 bitmasks."""

    rows: torch.Tensor  # [R] int64
    masks: torch.Tensor  # [R, ceil(V / 32)] int32, bit t % 32 of word t // 32: token t


@dataclass(frozen=True, slots=True)
class Truncation:
    """Temperature and the truncation knobs; a field is None when no row uses it."""

    temperature: torch.Tensor | None  # [B, 1] float32, 1 for greedy rows; None when all are 1
    min_p: torch.Tensor | None  # [B, 1] float32, 0 = off
    top_k: torch.Tensor | None  # [B, 1] int64, 0 = off
    max_top_k: int
    top_p: torch.Tensor | None  # [B, 1] float32, 1 = off


@dataclass(frozen=True, slots=True)
class PenaltyBatch:
    """The rows with penalties and their token history, padded with id V (a dropped column)."""

    rows: torch.Tensor  # [P] int64, batch rows
    history: torch.Tensor  # [P, L] int64, prompt + output ids, padded with V
    prompt_lens: torch.Tensor  # [P, 1] int64
    repetition: torch.Tensor  # [P, 1] float32, 1 = off
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32


@dataclass(frozen=True, slots=True)
class LogprobsRequest:
    """Which rows asked for logprobs, and how many top alternatives each wants."""

    rows: tuple[int, ...]  # batch rows, host side
    rows_device: torch.Tensor  # [R] int64
    num_top: tuple[int, ...]  # per entry of rows


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """One step's sampling parameters as device tensors; a field is None when no row uses it."""

    size: int
    request_ids: tuple[str, ...]
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool; None when no row is greedy or all are
    truncation: Truncation
    logit_bias: TokenBias | None
    banned: TokenEntries | None
    allowed: AllowedMasks | None
    penalties: PenaltyBatch | None
    # (batch row, generator seed) per seeded random row; see seeded_generator_seed.
    seeded_rows: tuple[tuple[int, int], ...]
    any_unseeded_random: bool
    logprobs: LogprobsRequest | None

    @property
    def needs_processing(self) -> bool:
        """Whether any row changes its logits before the argmax or the race."""
        return not self.all_greedy or any(
            x is not None for x in (self.logit_bias, self.banned, self.allowed, self.penalties)
        )


# A tensor's copy elsewhere (to the host, see SamplerOutput.map).
TensorMap = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of the chosen tokens of the rows that asked, still on the device."""

    rows: tuple[int, ...]  # batch rows (host)
    num_top: tuple[int, ...]
    token_logprobs: torch.Tensor  # [R] float32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, N] int64, N = max(num_top)
    top_logprobs: torch.Tensor  # [R, N] float32

    def map(self, fn: TensorMap) -> LogprobsTensors:
        return LogprobsTensors(
            self.rows, self.num_top, fn(self.token_logprobs), fn(self.ranks), fn(self.top_ids),
            fn(self.top_logprobs),
        )  # fmt: skip

    def to_host(self, token_ids: Sequence[int]) -> list[TokenLogprobs]:
        """One TokenLogprobs per entry; token_ids[i] is the token chosen at entry i. Syncs."""
        lps = self.token_logprobs.tolist()
        ranks = self.ranks.tolist()
        top_ids = self.top_ids.tolist()
        top_lps = self.top_logprobs.tolist()
        return [
            TokenLogprobs(
                token_id=token_ids[i],
                logprob=lps[i],
                rank=ranks[i],
                top=tuple(zip(top_ids[i][:n], top_lps[i][:n], strict=True)),
            )
            for i, n in enumerate(self.num_top)
        ]


@dataclass(slots=True)
class SamplerOutput:
    """Sampled tokens (and logprobs) of one batch, on the device until `to_host`."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None

    def map(self, fn: TensorMap) -> SamplerOutput:
        """The output with `fn` applied to each tensor (a copy to the host, say)."""
        logprobs = None if self.logprobs is None else self.logprobs.map(fn)
        return SamplerOutput(fn(self.token_ids), logprobs)

    def to_host(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Copy to the host (the one sync), keyed by request; `chunks` are the step's chunks
        given to `prepare`, one sampling row each."""
        request_ids = [c.request_id for c in chunks if c.sample]
        if len(request_ids) != self.token_ids.shape[0]:
            raise ValueError(
                f"chunks hold {len(request_ids)} sampling requests, the output "
                f"{self.token_ids.shape[0]} rows"
            )
        token_ids, logprobs = self.rows_to_host()
        sampled = dict(zip(request_ids, token_ids, strict=True))
        return sampled, {request_ids[r]: e for r, e in logprobs.items()}

    def rows_to_host(self) -> tuple[list[int], dict[int, TokenLogprobs]]:
        """Copy to the host (the one sync): each row's token, and the logprobs of the rows that
        asked, by row."""
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return token_ids, {}
        rows = self.logprobs.rows
        entries = self.logprobs.to_host([token_ids[r] for r in rows])
        return token_ids, dict(zip(rows, entries, strict=True))


class Sampler:
    """Samples one token per row of a [B, V] logits tensor; owns the random generators."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        *,
        seed: int | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        cpu_kernels: NativeKernels | None = None,
    ) -> None:
        """With `cpu_kernels` on the CPU, the race and the top_p thresholds run as native
        kernels (a seeded row's draw then depends on its seed alone, as with torch's
        generators, but draws other values); else as torch ops."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs  # -1: no cap
        self.cpu_kernels = cpu_kernels if self.device.type == "cpu" else None
        self._pin = self.device.type == "cuda"
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed & _MASK64)
        # Reseeded for every seeded row, so it carries no state between rows or steps.
        self._seeded_generator = torch.Generator(device=self.device)

    # ---- host side -----------------------------------------------------------------------------

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> SamplingBatch:
        """Build the batch from the chunks with sample=True, in order. Raises ValueError on
        parameters this vocabulary cannot serve (see validate_sampling_params)."""
        sampling = [c for c in chunks if c.sample]
        params = [c.sampling_params for c in sampling]
        for p in params:
            validate_sampling_params(p, self.vocab_size, self.max_logprobs)
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        seeded = tuple(
            (i, seeded_generator_seed(s, sampling[i].output_index))
            for i in random_rows
            if (s := params[i].seed) is not None
        )
        # Grammars fill their masks here, on the runner thread (see ScheduledChunk.constraints).
        masks = [None if c.constraints is None else c.constraints.next_mask() for c in sampling]
        return SamplingBatch(
            size=len(sampling),
            request_ids=tuple(c.request_id for c in sampling),
            all_greedy=all_greedy,
            greedy=None if all_greedy or not any(greedy) else self._tensor(greedy, torch.bool),
            truncation=self._truncation(params, greedy),
            logit_bias=self._logit_bias(params),
            banned=self._banned(sampling, masks),
            allowed=self._allowed(masks),
            penalties=self._penalties(sampling),
            seeded_rows=seeded,
            any_unseeded_random=len(seeded) < len(random_rows),
            logprobs=self._logprobs_request(params),
        )

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(data, dtype=dtype, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, through pinned memory: a plain copy would wait for
        the forward pass queued before it."""
        if self._pin:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _column(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return self._tensor(data, dtype).unsqueeze(1)

    def _truncation(self, params: list[SamplingParams], greedy: list[bool]) -> Truncation:
        # Greedy rows get neutral values: they skip temperature and truncation.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        top_ks = [
            0 if g or p.top_k >= self.vocab_size else max(p.top_k, 0)
            for p, g in zip(params, greedy, strict=True)
        ]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        f32 = torch.float32
        return Truncation(
            temperature=self._column(temps, f32) if any(t != 1.0 for t in temps) else None,
            min_p=self._column(min_ps, f32) if any(m > 0.0 for m in min_ps) else None,
            top_k=self._column(top_ks, torch.int64) if any(top_ks) else None,
            max_top_k=max(top_ks, default=0),
            top_p=self._column(top_ps, f32) if any(t < 1.0 for t in top_ps) else None,
        )

    def _logit_bias(self, params: list[SamplingParams]) -> TokenBias | None:
        entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        if not entries:
            return None
        rows, cols, values = zip(*entries, strict=True)
        return TokenBias(
            self._tensor(list(rows), torch.int64),
            self._tensor(list(cols), torch.int64),
            self._tensor(list(values), torch.float32),
        )

    def _banned(
        self, chunks: list[ScheduledChunk], masks: list[np.ndarray | None]
    ) -> TokenEntries | None:
        # Ids past the vocabulary can never be sampled anyway (e.g. a user's stop token id).
        entries = [
            (i, t)
            for i, (c, mask) in enumerate(zip(chunks, masks, strict=True))
            for t in bans_within(mask, c.banned_token_ids)
            if 0 <= t < self.vocab_size
        ]
        if not entries:
            return None
        rows, cols = zip(*entries, strict=True)
        return TokenEntries(
            self._tensor(list(rows), torch.int64), self._tensor(list(cols), torch.int64)
        )

    def _allowed(self, masks: list[np.ndarray | None]) -> AllowedMasks | None:
        given = [(i, mask) for i, mask in enumerate(masks) if mask is not None]
        if not given:
            return None
        rows = [i for i, _ in given]
        words = self._upload(torch.from_numpy(np.stack([mask for _, mask in given])))
        return AllowedMasks(self._tensor(rows, torch.int64), words)

    def _penalties(self, chunks: list[ScheduledChunk]) -> PenaltyBatch | None:
        rows = [i for i, c in enumerate(chunks) if c.sampling_params.has_penalties]
        if not rows:
            return None
        for i in rows:
            if chunks[i].history is None:
                raise ValueError(
                    f"history must be set for request {chunks[i].request_id!r}: it has penalties"
                )
        # A row samples after its history and the drafts before it (core/spec_decode.py); the
        # rows of one request share the history, converted to an array once.
        widths = [len(chunks[i].history or ()) + len(chunks[i].draft_token_ids) for i in rows]
        padded = np.full((len(rows), max(1, *widths)), self.vocab_size, dtype=np.int64)
        arrays: dict[int, np.ndarray] = {}
        for r, i in enumerate(rows):
            history = chunks[i].history or ()
            base = arrays.get(id(history))
            if base is None:
                base = arrays[id(history)] = np.fromiter(history, np.int64, len(history))
            padded[r, : len(base)] = base
            padded[r, len(base) : widths[r]] = chunks[i].draft_token_ids
        params = [chunks[i].sampling_params for i in rows]
        f32 = torch.float32
        return PenaltyBatch(
            rows=self._tensor(rows, torch.int64),
            history=self._upload(torch.from_numpy(padded)),
            prompt_lens=self._column([chunks[i].prompt_len for i in rows], torch.int64),
            repetition=self._column([p.repetition_penalty for p in params], f32),
            frequency=self._column([p.frequency_penalty for p in params], f32),
            presence=self._column([p.presence_penalty for p in params], f32),
        )

    def _logprobs_request(self, params: list[SamplingParams]) -> LogprobsRequest | None:
        rows = tuple(i for i, p in enumerate(params) if p.logprobs is not None)
        if not rows:
            return None
        return LogprobsRequest(
            rows=rows,
            rows_device=self._tensor(list(rows), torch.int64),
            num_top=tuple(params[i].logprobs or 0 for i in rows),
        )

    # ---- device side ---------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]; `logits` is left unchanged. No host sync."""
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"logits must be [{batch.size}, V], got {list(logits.shape)}")
        if logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must have {self.vocab_size} columns, got {logits.shape[1]}")
        if not batch.needs_processing:
            token_ids = argmax(logits)
        else:
            token_ids = self._sample_processed(logits.to(torch.float32, copy=True), batch)
        logprobs = None
        if batch.logprobs is not None:
            logprobs = _logprobs_of(logits, token_ids, batch.logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample_processed(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        process_logits(logits, batch, self.cpu_kernels)
        if batch.all_greedy:
            return argmax(logits)
        greedy_ids = argmax(logits) if batch.greedy is not None else None
        kernels = self.cpu_kernels
        truncate_logits(logits, batch, kernels.top_p_thresholds if kernels else None)
        if kernels is not None:
            token_ids = kernels.race_argmax(logits, self._race_keys(batch))
        else:
            probs = logits.softmax(dim=-1)
            # Exp(1) noise can round to 0; keep it positive so masked tokens stay at exactly 0.
            noise = self._noise(probs, batch).clamp_(min=torch.finfo(probs.dtype).tiny)
            token_ids = argmax(probs.div_(noise))
        if greedy_ids is not None and batch.greedy is not None:
            token_ids = torch.where(batch.greedy, greedy_ids, token_ids)
        return token_ids

    def _noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if batch.any_unseeded_random:
            exponential_(noise, self._generator)
        for row, seed in batch.seeded_rows:
            self._seeded_generator.manual_seed(seed)
            exponential_(noise[row], self._seeded_generator)
        return noise

    def _race_keys(self, batch: SamplingBatch) -> list[int]:
        """The native race's key of each row: the seeded rows' own, the others derived from
        one draw of the shared generator."""
        base = int(torch.randint(0, 2**62, (), generator=self._generator))
        keys = [seeded_generator_seed(base, row) for row in range(batch.size)]
        for row, seed in batch.seeded_rows:
            keys[row] = seed
        return keys


def exponential_(out: torch.Tensor, generator: torch.Generator) -> None:
    """Fill `out` with Exp(1) draws. On the CPU, `Tensor.exponential_` takes about 17 ns an
    element (13 ms over 16 x 49152 logits, a third of a decode step); -log of a uniform draw
    about 3 ns. A draw of U = 0 is raised to the smallest normal number: -log(0) = inf would take
    its token out of the race, and with every other token masked, leave a masked one to win."""
    if out.device.type != "cpu":
        out.exponential_(generator=generator)
        return
    out.uniform_(generator=generator).clamp_(min=torch.finfo(out.dtype).tiny).log_().neg_()


def argmax(values: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value, the first one on ties (as `argmax`). On the CPU,
    `max(dim).indices` takes 0.9 ms over [64, 49152] where `argmax` takes 2.3."""
    return values.max(dim=-1).indices


def process_logits(
    logits: torch.Tensor, batch: SamplingBatch, kernels: NativeKernels | None = None
) -> torch.Tensor:
    """Apply logit_bias, banned ids, allowed masks and penalties to `logits` [B, V] float32
    in place."""
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        logits.index_put_((bias.rows, bias.cols), bias.values, accumulate=True)
    if batch.banned is not None:
        banned = batch.banned
        # A device-side fill, not a host scalar: no copy to the device on this path.
        neg_inf = torch.full_like(banned.cols, float("-inf"), dtype=logits.dtype)
        logits.index_put_((banned.rows, banned.cols), neg_inf)
    if batch.allowed is not None:
        apply_token_masks(logits, batch.allowed.rows, batch.allowed.masks, kernels)
    if batch.penalties is not None:
        pen = batch.penalties
        rows = logits.index_select(0, pen.rows)
        logits.index_copy_(0, pen.rows, _apply_penalties(rows, pen))
    return logits


def _apply_penalties(logits: torch.Tensor, pen: PenaltyBatch) -> torch.Tensor:
    """The penalties of rows [P, V], computed at the ids of their histories only (gathered,
    penalised, scattered back): over the whole rows it took 4-5 ms a step on the CPU."""
    vocab = logits.shape[1]
    history = pen.history.masked_fill((pen.history < 0) | (pen.history > vocab), vocab)
    positions = torch.arange(history.shape[1], device=history.device)
    output = history.masked_fill(positions.unsqueeze(0) < pen.prompt_lens, vocab)
    # Column `vocab` absorbs padding and ids past the vocabulary; it is dropped at the end.
    # Each scatter writes the same value to every copy of a repeated id.
    padded = torch.nn.functional.pad(logits, (0, 1))
    seen = padded.gather(1, history)
    penalised = torch.where(seen > 0, seen / pen.repetition, seen * pen.repetition)
    padded.scatter_(1, history, penalised)
    counts = _counts(output, vocab).gather(1, output)
    current = padded.gather(1, output)
    presence = pen.presence * (counts > 0).to(logits.dtype)
    padded.scatter_(1, output, current - pen.frequency * counts - presence)
    return padded[:, :vocab]


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))


def truncate_logits(
    logits: torch.Tensor, batch: SamplingBatch, top_p_thresholds: TopPThresholds | None = None
) -> torch.Tensor:
    """Apply temperature, min_p, top_k and top_p to `logits` [B, V] float32 in place."""
    t = batch.truncation
    if t.temperature is not None:
        logits.div_(t.temperature)
    if t.min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps all.
        floor = logits.amax(dim=-1, keepdim=True) + t.min_p.log()
        logits.masked_fill_(logits < floor, float("-inf"))
    if t.top_p is not None and top_p_thresholds is not None and logits.device.type == "cpu":
        if t.top_k is not None:
            _apply_top_k(logits, t.top_k, t.max_top_k)
        logits.masked_fill_(logits < top_p_thresholds(logits, t.top_p), float("-inf"))
    elif t.top_p is not None:
        _apply_top_k_top_p(logits, t.top_k, t.top_p)
    elif t.top_k is not None:
        _apply_top_k(logits, t.top_k, t.max_top_k)
    return logits


def _kth_largest(values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """values sorted descending [B, K]; top_k [B, 1] (0 = off) -> threshold [B, 1]."""
    kth = values.gather(1, (top_k.clamp(1, values.shape[1]) - 1))
    return kth.masked_fill(top_k == 0, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    values = logits.topk(max_top_k, dim=-1).values
    logits.masked_fill_(logits < _kth_largest(values, top_k), float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> None:
    ordered = logits.sort(dim=-1, descending=True).values
    if top_k is not None:
        kth = _kth_largest(ordered, top_k)
        ordered.masked_fill_(ordered < kth, float("-inf"))
        logits.masked_fill_(logits < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass of the more likely tokens
    # Kept tokens are a prefix of `ordered`; its last entry sets the threshold.
    last = ((before < top_p).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    threshold = ordered.gather(1, last).masked_fill_(top_p >= 1.0, float("-inf"))
    logits.masked_fill_(logits < threshold, float("-inf"))


def _logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, request: LogprobsRequest
) -> LogprobsTensors:
    rows = request.rows_device
    logprobs = logits.index_select(0, rows).float().log_softmax(dim=-1)
    chosen, ranks, top_ids, top_lps = _gather_logprobs(
        logprobs, token_ids.index_select(0, rows), max(request.num_top)
    )
    return LogprobsTensors(request.rows, request.num_top, chosen, ranks, top_ids, top_lps)


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen logprob [R], rank [R] (tokens at least as likely, vLLM's rule), top-N ids / lps."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_lps, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen.squeeze(1), ranks, top_ids, top_lps


def prompt_logprobs_tensors(
    logits: torch.Tensor, targets: Sequence[int], num_top: int
) -> LogprobsTensors:
    """Logprobs of each prompt target, on the device: row i of `logits` [T, V] (at most
    PROMPT_LOGPROBS_ROWS) predicts targets[i]. `targets` may be one shorter than T (the last
    prefill chunk has no next prompt token)."""
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"prompt_logprobs must be in [0, {logits.shape[1]}], got {num_top}")
    if len(targets) > logits.shape[0]:
        raise ValueError(f"targets must be at most {logits.shape[0]} long, got {len(targets)}")
    host_ids = torch.tensor(list(targets), dtype=torch.int64, pin_memory=logits.is_cuda)
    ids = host_ids.to(logits.device, non_blocking=True)
    lps = logits[: len(targets)].float().log_softmax(dim=-1)
    chosen, ranks, top_ids, top_lps = _gather_logprobs(lps, ids, num_top)
    count = len(targets)
    return LogprobsTensors(tuple(range(count)), (num_top,) * count, chosen, ranks, top_ids, top_lps)


def compute_prompt_logprobs(
    logits: torch.Tensor, targets: Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of each prompt target: row i of `logits` [T, V] predicts targets[i]. Syncs."""
    out: list[TokenLogprobs] = []
    for start in range(0, max(len(targets), 1), PROMPT_LOGPROBS_ROWS):
        part = list(targets[start : start + PROMPT_LOGPROBS_ROWS])
        rows = logits[start : start + PROMPT_LOGPROBS_ROWS]
        out.extend(prompt_logprobs_tensors(rows, part, num_top).to_host(part))
    return out
