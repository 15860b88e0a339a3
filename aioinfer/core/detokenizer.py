"""Incremental detokenization: per-step text deltas, UTF-8 holdback and stop strings.

The scheduler feeds each request's sampled tokens to its `IncrementalDetokenizer` and takes the
text that is safe to stream. Only a small window of tokens is decoded per step (the prefix /
read-offset method), so the cost of a step does not grow with the length of the output:

    window:  [ context tokens .......... | tokens not committed yet ]
             0                      read ^                      len(window)
    prefix_text = decode(window[:read])        (cached)
    full        = decode(window)
    new text    = full[len(prefix_text):]      committed unless it ends in U+FFFD

The context is the last tokens of the previous commit (initially the last prompt tokens), so the
decoder sees each new token in place: SentencePiece's "▁word" becomes " word" and not "word".

What equality holds (no `clean_up_tokenization_spaces` is applied, as in vLLM):
- Byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): the concatenated deltas equal
  `tokenizer.decode(output_ids, skip_special_tokens=...)` exactly, including the U+FFFD of bytes
  that never form a character.
- Decoders that read the first token differently (Metaspace / SentencePiece "▁"): the output is
  decoded in the context of the prompt, as vLLM does, so it equals
  `decode(prompt + output)[len(decode(prompt)):]` and keeps the leading space of its first word,
  which `decode(output_ids)` drops. With no visible prompt token (an empty prompt, or one whose
  last tokens end in an unfinished character) it equals `decode(output_ids)`.
- Byte-fallback decoders (`<0xE4>` tokens) decode a run of byte tokens as one: invalid as a
  whole, every byte of it is U+FFFD, so new byte tokens could change how committed ones read.
  The context therefore never ends in a byte token: a plain token ("a") stands in for it. A
  stream that had already emitted a valid character of a run keeps it, and the text after a run
  is never lost; only the count of U+FFFD for invalid bytes may differ from a full decode.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import tokenizers

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes that are not (yet) a character
_CONTEXT_TOKENS = 6  # prompt tokens decoded as context for the first output token
# A character is at most 4 bytes, so more held tokens than this means invalid bytes: the window
# is split at a safe point instead of growing.
_MAX_PENDING_TOKENS = 8
_MAX_WINDOW_TOKENS = 32  # bound on context kept across tokens that decode to nothing

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Plain one-letter tokens, one of which stands in as context for committed byte tokens.
_ANCHOR_PIECES = ("a", "e", "x")

Decode = Callable[[list[int]], str]


def _byte_fallback(tokenizer: Any) -> tuple[Callable[[int], bool], int | None]:
    """Whether an id is a byte-fallback token (`<0xE4>`), and a plain token to stand in for
    them as context; (never, None) for tokenizers without byte fallback."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, tokenizers.Tokenizer) or not getattr(
        backend.model, "byte_fallback", False
    ):
        return (lambda _: False), None
    anchor = next(
        (i for piece in _ANCHOR_PIECES if (i := backend.token_to_id(piece)) is not None), None
    )

    def is_byte_token(token_id: int) -> bool:
        piece = backend.id_to_token(token_id)
        return piece is not None and _BYTE_TOKEN.fullmatch(piece) is not None

    return is_byte_token, anchor


def _decode_fn(tokenizer: Any, skip_special_tokens: bool) -> tuple[Decode, frozenset[int]]:
    """A decode function over a list of ids, and the ids it would skip (dropped up front, so
    they never take room in the window)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if isinstance(backend, tokenizers.Tokenizer):
        skipped: frozenset[int] = frozenset()
        if skip_special_tokens:
            added = backend.get_added_tokens_decoder()
            skipped = frozenset(i for i, token in added.items() if token.special)

        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode, skipped

    def decode_slow(ids: list[int]) -> str:
        return str(
            tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        )

    special = getattr(tokenizer, "all_special_ids", ()) if skip_special_tokens else ()
    return decode_slow, frozenset(special)


def _decodes_by_concatenation(tokenizer: Any) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) whenever decode(a) ends on a whole
    character: a plain byte-level decoder (GPT-2's, Llama 3's, Qwen's, SmolLM2's), which maps
    each token to bytes and the bytes to text. Metaspace and byte-fallback decoders are not:
    they read a token differently at the start of a sequence."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return isinstance(backend, tokenizers.Tokenizer) and isinstance(
        backend.decoder, tokenizers.decoders.ByteLevel
    )


def _stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
    return stops


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, and finds its stop strings.

    Call `update` with each step's new tokens until it returns a stop string or the request
    ends otherwise, and `take_delta` after each update (with `finished=True` once at the end).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._decode, self._skipped = _decode_fn(tokenizer, skip_special_tokens)
        self._is_byte_token, self._anchor = _byte_fallback(tokenizer)
        self._concatenates = _decodes_by_concatenation(tokenizer)
        self._stops = _stop_strings(stop)
        self._include_stop = include_stop_str_in_output
        # Characters before new text that a stop string can start in.
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        self._window, self._prefix_text = self._prompt_context(prompt_token_ids)
        self._read = len(self._window)
        self._pending_text = ""  # provisional text of window[read:], ends in U+FFFD
        self._chunks: list[str] = []  # committed output text
        self._tail = ""  # last `_tail_len` committed characters
        self._unsent = ""  # committed text that take_delta has not returned yet
        self._check_stop = True
        self._matched: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """The output so far, cut at a matched stop string. Until `take_delta(finished=True)` it
        may end in a provisional U+FFFD for a character whose bytes are still arriving. Costs
        O(length): read it at the end, not every step."""
        return self._committed() + self._pending_text

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._matched

    def update(self, new_token_ids: Sequence[int], *, check_stop: bool = True) -> str | None:
        """Feed newly sampled tokens. Returns the stop string that matched, or None.

        `check_stop=False` (before `min_tokens`) decodes without looking for stop strings; a
        later check only finds stop strings that end in text added after it. After a match the
        output is cut at the stop string (kept with `include_stop_str_in_output`); calling
        update again, or after `take_delta(finished=True)`, raises RuntimeError.
        """
        if self._matched is not None or self._finished:
            raise RuntimeError("update() called after the output ended")
        self._check_stop = check_stop
        ids = [t for t in new_token_ids if t not in self._skipped]
        if not ids:
            return None
        self._window.extend(ids)
        return self._decode_window()

    def take_delta(self, finished: bool = False) -> str:
        """Text not returned before that is safe to stream.

        Holds back trailing U+FFFD characters (a final one waits for the next character) and a
        trailing part of the text that could start a stop string. `finished=True` commits what
        is still held and returns everything left; the concatenation of all deltas then equals
        `output_text`.
        """
        if finished and not self._finished:
            self._finished = True
            self._flush()
        text = self._unsent
        final = self._finished or self._matched is not None
        cut = len(text) if final else len(text) - self._holdback(text)
        self._unsent = text[cut:]
        return text[:cut]

    # ------------------------------------------------------------------ decoding

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
        """The last visible prompt tokens and their text, or nothing where that text ends in an
        unfinished character (its bytes must not merge with the output's)."""
        context: list[int] = []
        for token in reversed(prompt_token_ids):
            if token not in self._skipped:
                context.append(token)
                if len(context) == _CONTEXT_TOKENS:
                    break
        context.reverse()
        if context and self._anchor is not None and self._is_byte_token(context[-1]):
            context = [self._anchor]  # as in _advance
        text = self._decode(context) if context else ""
        if text.endswith(REPLACEMENT_CHAR):
            return [], ""
        return context, text

    def _decode_window(self) -> str | None:
        full = self._decode(self._window)
        if not full.endswith(REPLACEMENT_CHAR):
            return self._commit(len(self._window), full)
        if len(self._window) - self._read > _MAX_PENDING_TOKENS:
            end, text = self._safe_split(full)
            whole = end == len(self._window)
            stop = self._commit(end, text)
            if stop is not None or whole:
                return stop
            full = self._decode(self._window)
        self._pending_text = full[len(self._prefix_text) :]
        return None

    def _safe_split(self, full: str) -> tuple[int, str]:
        """The last split of the held tokens whose left side is final text: decoding both sides
        apart gives the same text as decoding them together. Falls back to the whole window."""
        window = self._window
        for end in range(len(window) - 1, self._read, -1):
            left = self._decode(window[:end])
            if left + self._decode(window[end:]) == full:
                return end, left
        return len(window), full

    def _commit(self, end: int, text: str) -> str | None:
        """Commit window[read:end], whose context-including text is `text`."""
        new_text = text[len(self._prefix_text) :]
        self._pending_text = ""
        # A byte-level decoder decodes a sequence as the concatenation of its parts where the
        # first ends on a character, as committed text does: the new tokens' own text is known.
        self._advance(end, text, new_text if self._concatenates else None)
        return self._append(new_text)

    def _advance(self, end: int, text: str, last: str | None = None) -> None:
        """Make window[read:end] (whose own text is `last`, decoded here when not given) the
        new context, unless it decodes to nothing (a lone "▁word" must not lose its space):
        then the old context stays."""
        if last is None:
            last = self._decode(self._window[self._read : end])
        if last or len(self._window) > _MAX_WINDOW_TOKENS:
            del self._window[: self._read]
            end -= self._read
            text = last
        if end and self._anchor is not None and self._is_byte_token(self._window[end - 1]):
            # Byte tokens after it would join its run and change how it reads.
            self._window[:end] = [self._anchor]
            end, text = 1, self._decode([self._anchor])
        self._read = end
        self._prefix_text = text

    def _committed(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _flush(self) -> None:
        if self._pending_text and self._matched is None:
            pending, self._pending_text = self._pending_text, ""
            self._append(pending)

    # ------------------------------------------------------------------ stop strings

    def _append(self, new_text: str) -> str | None:
        """Add committed text; cut the output at the first stop string that ends in it."""
        if not new_text:
            return None
        searched = self._tail + new_text
        match = self._find_stop(searched) if self._check_stop else None
        self._chunks.append(new_text)
        self._unsent += new_text
        if self._tail_len:
            self._tail = searched[-self._tail_len :]
        if match is None:
            return None
        stop, cut = match
        self._truncate(len(searched) - cut)
        self._matched = stop
        return stop

    def _find_stop(self, searched: str) -> tuple[str, int] | None:
        """The stop string that completes first in `searched` (the longest on a tie) and where
        the output ends: before it, or after it with include_stop_str_in_output. Only matches
        that end past the old tail count: those inside it were looked for before."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            index = searched.find(stop, max(0, len(self._tail) - len(stop) + 1))
            if index >= 0:
                key = (index + len(stop), -len(stop), stop)
                best = key if best is None else min(best, key)
        if best is None:
            return None
        end, neg_len, stop = best
        return stop, (end if self._include_stop else end + neg_len)

    def _truncate(self, count: int) -> None:
        """Drop the last `count` committed characters. They are all unsent: take_delta holds
        back any text a stop string could start in."""
        if count <= 0:
            return
        self._chunks = [self._committed()[:-count]]
        self._unsent = self._unsent[: max(0, len(self._unsent) - count)]

    def _holdback(self, text: str) -> int:
        """How many trailing characters of `text` must wait: U+FFFD (the bytes of a character
        may still be arriving) and, before them, a part that could start a stop string. What is
        left must not end in U+FFFD either."""
        kept = text.rstrip(REPLACEMENT_CHAR)
        if not self._include_stop:
            longest = 0
            for stop in self._stops:
                for size in range(min(len(stop) - 1, len(kept)), longest, -1):
                    if kept.endswith(stop[:size]):
                        longest = size
                        break
            kept = kept[: len(kept) - longest].rstrip(REPLACEMENT_CHAR)
        return len(text) - len(kept)
