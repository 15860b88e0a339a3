"""Embeddings from a decoder's final hidden states: vLLM's pooling runner.

A pooling request is a prompt that is prefilled and never decoded. Each chunk of it hands back
what its pooling type needs of the chunk's hidden states (`ModelRunner._pool`), the scheduler
folds the parts (`fold`), and once the prompt is done `embedding` makes the vector: the mean, or
the last or first token's state, cut to `dimensions` (Matryoshka) and L2-normalized when asked.
`cosine` scores a pair of them (/score, /rerank).

    LAST  the last prompt token's state (decoder embedding models: Qwen3-Embedding, gte-Qwen2)
    MEAN  the mean over the prompt's tokens
    CLS   the first token's state

Which type a model uses comes from `--pooler-config`, else from its sentence-transformers files
(`modules.json`, `1_Pooling/config.json`), else from a GGUF's declared pooling type, else LAST
with normalization, as vLLM does.

A classifier (`*ForSequenceClassification`: reward models, cross-encoder rerankers) pools the
last token through its `score` head, which the runner applies; its "embedding" is the class
probabilities (`class_probabilities`): a softmax over the labels, or the sigmoid of a single
logit, as vLLM's classify and score give them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

_T = TypeVar("_T")

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
# sentence-transformers' 1_Pooling/config.json flags -> our pooling types.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns hidden states into an embedding."""

    pooling_type: str = "LAST"
    normalize: bool = True
    # A classifier's labels by class index (config.json's id2label); empty for embeddings.
    labels: tuple[str, ...] = ()
    # A classifier scores the last token that is not this one (as transformers does).
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        if self.labels and self.pooling_type != "LAST":
            raise ValueError(
                f"a classifier pools the last token, got pooling_type {self.pooling_type!r}"
            )

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    def pooled_prompt(self, token_ids: list[int]) -> list[int]:
        """What a classifier reads of a prompt: without its trailing pad tokens (at least one
        token kept). transformers scores the last non-pad token; under causal attention the
        states before it do not depend on what follows, so dropping the tail is exact."""
        pad = self.pad_token_id
        if not self.classifies or pad is None:
            return token_ids
        end = len(token_ids)
        while end > 1 and token_ids[end - 1] == pad:
            end -= 1
        return token_ids[:end]

    @property
    def reads_every_token(self) -> bool:
        """Whether a prompt's every hidden state counts, so that no prefix may come from the
        prefix cache: MEAN reads them all, CLS the first."""
        return self.pooling_type != "LAST"

    def check_cross_encoder(self) -> None:
        """Scoring text pairs as one prompt (/score, /rerank, LLM.score on a classifier) needs
        one label, whose probability is the score; ValueError otherwise."""
        if len(self.labels) != 1:
            raise ValueError(
                f"scoring needs a classifier of one label (a cross-encoder); this model has "
                f"{len(self.labels)}"
            )

    def describe(self) -> str:
        if self.classifies:
            return f"classifier of {len(self.labels)} label(s) over the last token"
        return (
            f"{self.pooling_type} pooling, {'normalized' if self.normalize else 'not normalized'}"
        )


@dataclass(frozen=True)
class PoolingParams:
    """Per request (vLLM's names): `dimensions` keeps the first d values (before normalizing);
    `normalize` None takes the model's setting."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer or None, got {value!r:.80}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean or None, got {self.normalize!r:.80}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        keep = self.truncate_prompt_tokens
        if keep is not None and keep < 1 and keep != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {keep}")


def fold(
    pooling_type: str, folded: np.ndarray | None, part: np.ndarray | None
) -> np.ndarray | None:
    """The parts of a prompt's chunks so far, with one more chunk's: summed for MEAN (in
    float64), the latest for LAST, the first for CLS."""
    if part is None:
        return folded
    if pooling_type == "MEAN":
        part64 = part.astype(np.float64)
        return part64 if folded is None else folded + part64
    if pooling_type == "CLS" and folded is not None:
        return folded
    return part


def embedding(
    folded: np.ndarray, num_tokens: int, params: PoolingParams, config: PoolerConfig
) -> np.ndarray:
    """The float32 embedding of a prompt of `num_tokens` tokens from its folded parts (a
    classifier's: its class probabilities)."""
    if config.classifies:
        return class_probabilities(folded)
    if config.pooling_type == "MEAN":
        vector = folded / num_tokens
    else:
        vector = folded.astype(np.float64)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        # As torch's F.normalize: a zero vector stays zero.
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)


def class_probabilities(logits: np.ndarray) -> np.ndarray:
    """float32 probabilities of a classifier's logits: softmax over several labels, the
    sigmoid of one (a cross-encoder's relevance, a binary classifier's positive class)."""
    x = logits.astype(np.float64)
    if x.shape[0] == 1:
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    e = np.exp(x - x.max())
    return (e / e.sum()).astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two embeddings (0 where either is zero), in float64: the score of a
    text pair with an embedding model, as vLLM's /score gives it."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if not (np.isfinite(a64).all() and np.isfinite(b64).all()):
        return math.nan  # a broken embedding is not hidden behind a plausible score
    norms = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    if norms == 0:
        return 0.0
    return min(1.0, max(-1.0, float(a64 @ b64) / norms))  # rounding may step past 1


def score_pairs(
    firsts: list[_T], seconds: list[_T], names: tuple[str, str] = ("text_1", "text_2")
) -> list[tuple[_T, _T]]:
    """The pairs to score: one first item against every second one (1:N), or pairwise (N:N).
    ValueError naming the argument (`names`) otherwise."""
    for name, items in zip(names, (firsts, seconds), strict=True):
        if not items:
            raise ValueError(f"{name} must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"{names[0]} must be one text or as many as {names[1]} ({len(seconds)}), got "
            f"{len(firsts)}"
        )
    return list(zip(firsts, seconds, strict=True))


def resolve_pooler(
    runner: str,
    override: dict[str, Any] | None,
    architecture: str,
    folder: Path | None,
    declared: str | None = None,
    labels: tuple[str, ...] = (),
    pad_token_id: int | None = None,
) -> PoolerConfig | None:
    """The pooler of a pooling model, or None for text generation. `auto` pools for
    architectures named `*Model` (a decoder without an LM head) and for sentence-transformers
    folders; `override` (--pooler-config) wins over what the folder says, and that over the
    pooling type the checkpoint `declared` (a GGUF's). `generate` reads no sentence-transformers
    files, so a folder whose files cannot be pooled still generates."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if is_classifier(architecture):
        return _classifier_pooler(runner, override, architecture, labels, pad_token_id)
    if runner == "generate":
        if override is not None:
            raise ValueError("pooler_config needs --runner pooling (or auto on an embedding model)")
        return None  # whatever sentence-transformers files the folder also holds
    try:
        from_folder = sentence_transformers_pooler(folder) if folder is not None else None
    except ValueError as exc:
        if runner == "auto":
            raise ValueError(f"{exc}; --runner generate serves the model for text") from None
        raise
    if runner == "auto" and not (architecture.endswith("Model") or from_folder is not None):
        if override is not None:
            raise ValueError(
                f"pooler_config needs --runner pooling: {architecture!r} is a text-generation "
                "architecture"
            )
        return None
    base = from_folder or PoolerConfig(declared or "LAST")
    if override is None:
        return base
    unknown = sorted(set(override) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config may set pooling_type and normalize, got {unknown}")
    normalize = override.get("normalize", base.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    pooling_type = override.get("pooling_type", base.pooling_type)
    return PoolerConfig(str(pooling_type).upper(), normalize)


def is_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def _classifier_pooler(
    runner: str,
    override: dict[str, Any] | None,
    architecture: str,
    labels: tuple[str, ...],
    pad_token_id: int | None,
) -> PoolerConfig:
    if runner == "generate":
        raise ValueError(
            f"architecture {architecture!r} is a classifier: it serves /classify, /score and "
            "/rerank (--runner pooling), not text"
        )
    if not labels:
        raise ValueError(f"the {architecture!r} config must name at least one label")
    if override:
        allowed = {"pooling_type": "LAST", "normalize": False}
        given = {k: v.upper() if k == "pooling_type" and isinstance(v, str) else v
                 for k, v in override.items()}  # fmt: skip
        wrong = sorted(k for k, v in given.items() if allowed.get(k, object()) != v)
        if wrong:
            raise ValueError(
                f"pooler_config: a classifier pools the last token unnormalized, got {wrong}"
            )
    return PoolerConfig("LAST", normalize=False, labels=labels, pad_token_id=pad_token_id)


def sentence_transformers_pooler(folder: Path) -> PoolerConfig | None:
    """The pooler a sentence-transformers folder describes, or None when it is not one.
    Raises ValueError for modules the runner cannot apply (a Dense projection, max pooling)."""
    path = folder / "modules.json"
    modules = _read_json(path)
    if modules is None:
        return None
    if not isinstance(modules, list):
        raise ValueError(f"{path} must hold a list of sentence-transformers modules")
    types = {str(m.get("type", "")): m for m in modules if isinstance(m, dict)}
    pooling = types.get(_ST_MODULE + "Pooling")
    if pooling is None:
        return None
    unsupported = sorted(
        t.removeprefix(_ST_MODULE)
        for t in types
        if t.removeprefix(_ST_MODULE) not in ("Transformer", "Pooling", "Normalize")
    )
    if unsupported:
        raise ValueError(
            f"{folder / 'modules.json'} has sentence-transformers modules that are not "
            f"supported: {unsupported}"
        )
    settings = _read_json(folder / str(pooling.get("path", "")) / "config.json") or {}
    if not isinstance(settings, dict):
        raise ValueError(f"the sentence-transformers pooling config of {folder} is not an object")
    if settings.get("include_prompt", True) is False:
        # Instruction models pool without their prompt's tokens: not what LAST/MEAN/CLS give.
        raise ValueError(
            f"the sentence-transformers pooling of {folder} excludes the prompt "
            "(include_prompt: false), which is not supported"
        )
    chosen = [kind for flag, kind in _ST_POOLING_MODES.items() if settings.get(flag)]
    others = [
        k
        for k, v in settings.items()
        if k.startswith("pooling_mode_") and v and k not in _ST_POOLING_MODES
    ]
    if len(chosen) != 1 or others:
        raise ValueError(
            f"the sentence-transformers pooling of {folder} must be exactly one of "
            f"{sorted(_ST_POOLING_MODES)}, got {sorted(chosen + others) or 'none'}"
        )
    return PoolerConfig(chosen[0], normalize=_ST_MODULE + "Normalize" in types)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
