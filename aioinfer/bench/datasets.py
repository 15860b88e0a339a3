"""Prompt sets for `aioinfer bench serve`, built from a seed alone: nothing is downloaded.

`random`: every prompt is `input_len` words drawn from WORDS, each of which is one token, with and
without a leading space, in SmolLM2's GPT-2-style BPE vocabulary (common English words are single
tokens in most BPE vocabularies of 32k entries and more). Words joined by spaces are split apart
by the pre-tokenizer, so N words are N tokens and the client needs no tokenizer. With a
tokenizer, prompts are fitted to exact token counts instead.

`sharegpt-like`: conversations of one to three user turns whose prompt and output lengths are
drawn from fixed long-tailed (lognormal) distributions, clipped the way ShareGPT benchmarks
filter (4 to 1024 prompt tokens, at least 4 output tokens), so workloads mix short and long
requests as chat traffic does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "body information back parent face others level office door health person art war history "
    "party result change reason research girl moment air teacher force education good new "
    "first last long great little own other old big high different small large next early "
    "young important few public bad same able say make go know take see come think look want "
    "give use find tell ask feel try leave call keep let begin help show play run move live "
    "write sit stand pay include continue set learn lead understand watch follow stop create "
    "read grow open walk win offer remember love consider buy wait die send expect build stay "
    "fall cut reach kill the of and to in for on with at by from up about into over after "
    "under between through during before without again also only just more most some such "
    "very well still even here there now then where when why how all each both many any these "
    "those this that what which who red blue green black white light dark close river road "
    "tree flower stone paper music song film sound color table chair window bread milk fish "
    "bird horse dog cat sun moon star rain snow wind fire earth sea ship train plane letter "
    "news page"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

DATASETS = ("random", "sharegpt-like")

# sharegpt-like lengths: lognormal(median, sigma), clipped to [lo, hi].
SHAREGPT_PROMPT = (120.0, 0.9, 4, 1024)
SHAREGPT_OUTPUT = (140.0, 0.8, 4, 1024)
# Probability of 1, 2 and 3 user turns in a conversation.
SHAREGPT_TURNS = (0.6, 0.25, 0.15)

# A tokenizer-specific word pool smaller than this is topped up from the vocabulary.
_MIN_POOL = 64


@dataclass(frozen=True)
class Sample:
    """One request of a workload."""

    prompt: str  # text for /v1/completions
    messages: list[dict[str, str]]  # the same for /v1/chat/completions
    prompt_len: int  # tokens of the content (exact with a tokenizer, by construction without)
    output_len: int  # max_tokens (and min_tokens when EOS is ignored)


class TextMaker:
    """Text of a requested token count: by construction from one-token words, or, given a
    tokenizer, fitted by encoding and trimming."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.words: tuple[str, ...] = WORDS if tokenizer is None else _word_pool(tokenizer)

    def make(self, rng: random.Random, num_tokens: int) -> tuple[str, int]:
        """(text, its token count) for a target of num_tokens >= 1."""
        text = " ".join(rng.choice(self.words) for _ in range(num_tokens))
        if self.tokenizer is None:
            return text, num_tokens
        return self._fit(rng, text, num_tokens)

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _fit(self, rng: random.Random, text: str, target: int) -> tuple[str, int]:
        # Merges across a cut can change the count, so re-encode until it settles.
        for _ in range(8):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                return text, target
            if len(ids) > target:
                text = self.tokenizer.decode(ids[:target])
            else:
                extra = " ".join(rng.choice(self.words) for _ in range(target - len(ids)))
                text = f"{text} {extra}"
        return text, self.count(text)


def _word_pool(tokenizer: Any) -> tuple[str, ...]:
    """Words that are one token for this tokenizer, alone and after a space."""

    def single(text: str) -> bool:
        return len(tokenizer.encode(text, add_special_tokens=False)) == 1

    pool = [w for w in WORDS if single(w) and single(" " + w)]
    if len(pool) < _MIN_POOL:
        pool += [w for w in _vocab_words(tokenizer) if w not in pool]
    # No single-token words at all (e.g. SentencePiece vocabularies): fitting handles it.
    return tuple(pool) if pool else WORDS


def _vocab_words(tokenizer: Any) -> list[str]:
    """Alphabetic vocabulary entries that are one token both with and without a leading space."""
    found = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        word = text[1:]
        if not (text.startswith(" ") and word.isascii() and word.isalpha()):
            continue
        if tokenizer.encode(text, add_special_tokens=False) != [token_id]:
            continue
        if len(tokenizer.encode(word, add_special_tokens=False)) == 1:
            found.append(word)
    return found


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, seed: int, tokenizer: Any = None
) -> list[Sample]:
    """Prompts of input_len tokens asking for output_len tokens each."""
    rng = random.Random(seed)
    maker = TextMaker(tokenizer)
    samples = []
    for _ in range(num_prompts):
        text, length = maker.make(rng, input_len)
        samples.append(Sample(text, [{"role": "user", "content": text}], length, output_len))
    return samples


def sharegpt_like_dataset(num_prompts: int, seed: int, tokenizer: Any = None) -> list[Sample]:
    """Synthetic conversations; prompt_len counts message contents, not template tokens."""
    rng = random.Random(seed)
    maker = TextMaker(tokenizer)
    return [_conversation(rng, maker) for _ in range(num_prompts)]


def _conversation(rng: random.Random, maker: TextMaker) -> Sample:
    prompt_len = draw_length(rng, *SHAREGPT_PROMPT)
    output_len = draw_length(rng, *SHAREGPT_OUTPUT)
    turns = rng.choices((1, 2, 3), weights=SHAREGPT_TURNS)[0]
    turns = min(turns, (prompt_len + 1) // 2)  # every message needs a token
    roles = ["user", "assistant"] * (turns - 1) + ["user"]
    sizes = split_length(rng, prompt_len, len(roles))
    messages, total = [], 0
    for role, size in zip(roles, sizes, strict=True):
        text, length = maker.make(rng, size)
        messages.append({"role": role, "content": text})
        total += length
    prompt = "\n\n".join(m["content"] for m in messages)
    return Sample(prompt, messages, total, output_len)


def draw_length(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    value = rng.lognormvariate(math.log(median), sigma)
    return max(lo, min(hi, round(value)))


def split_length(rng: random.Random, total: int, parts: int) -> list[int]:
    """total split into `parts` positive sizes, the last part the largest share, as the newest
    user message usually is."""
    if not 1 <= parts <= total:
        raise ValueError(f"parts must be in [1, total={total}], got {parts}")
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    largest = sizes.index(max(sizes))
    sizes[largest], sizes[-1] = sizes[-1], sizes[largest]
    return sizes


def make_dataset(
    name: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    tokenizer: Any = None,
) -> list[Sample]:
    if name == "random":
        return random_dataset(num_prompts, input_len, output_len, seed, tokenizer)
    if name == "sharegpt-like":
        return sharegpt_like_dataset(num_prompts, seed, tokenizer)
    raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")


def load_tokenizer(name: str) -> Any:
    """transformers' AutoTokenizer for a hub id, a folder, or a .gguf file."""
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(name)
