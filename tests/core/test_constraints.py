"""Token masks, bad words and the rule that a mask wins over bans, without a model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioinfer.core.constraints import (
    BadWords,
    TokenConstraints,
    allows_any_besides,
    bad_words_token_ids,
    bans_within,
    mask_allows,
    token_mask,
)
from aioinfer.core.request import Request
from aioinfer.core.sampling_params import SamplingParams
from tests.support.tokenizers import make_tokenizer

VOCAB = 100


@given(st.sets(st.integers(0, VOCAB - 1)))
def test_a_mask_allows_exactly_its_tokens(ids):
    mask = token_mask(ids, VOCAB)
    assert mask.dtype == np.int32 and mask.shape == (4,)
    assert mask_allows(mask, VOCAB).tolist() == sorted(ids)
    # xgrammar's layout: token i is bit i % 32 of word i // 32 (bit 31 makes a negative word).
    for token in ids:
        assert (int(mask[token // 32]) >> (token % 32)) & 1


@given(st.sets(st.integers(0, VOCAB - 1), min_size=1), st.sets(st.integers(0, VOCAB - 1)))
def test_allows_any_besides(allowed, banned):
    mask = token_mask(allowed, VOCAB)
    assert allows_any_besides(mask, sorted(banned)) == bool(allowed - banned)
    assert mask_allows(mask, VOCAB).tolist() == sorted(allowed)  # left unchanged


def test_bad_words_ban_single_tokens_always_and_the_last_of_a_sequence_after_the_rest():
    words = BadWords([(7,), (1, 2, 3), (4, 5)])
    assert words.banned_after([]) == [7]
    assert sorted(words.banned_after([9, 1, 2])) == [3, 7]
    assert sorted(words.banned_after([4])) == [5, 7]
    assert words.banned_after([1, 2, 9]) == [7]


def test_bad_words_are_tokenized_alone_and_after_a_space():
    tokenizer = make_tokenizer()
    sequences = bad_words_token_ids(["quick"], tokenizer)
    assert tuple(tokenizer.encode("quick", add_special_tokens=False)) in sequences
    spaced = tuple(tokenizer.encode(" quick", add_special_tokens=False))
    assert (spaced in sequences) == (len(spaced) == len(sequences[0]))


def _request(min_tokens: int, constraints: TokenConstraints) -> Request:
    params = SamplingParams(min_tokens=min_tokens, max_tokens=10)
    return Request(
        "r", [1, 2], params, max_tokens=10, eos_token_ids=frozenset({0}), constraints=constraints
    )


def test_a_mask_that_allows_only_banned_tokens_wins_over_the_bans():
    # A finished document allows only EOS, which min_tokens bans: EOS it is.
    only_eos = _request(5, TokenConstraints(allowed=token_mask([0], VOCAB)))
    assert only_eos.banned_token_ids() == (0,)
    assert bans_within(only_eos.constraints.next_mask(), only_eos.banned_token_ids()) == ()
    # With another allowed token the ban holds, and bad words join it.
    constraints = TokenConstraints(allowed=token_mask([0, 8], VOCAB), bad_words=BadWords([(9,)]))
    some = _request(5, constraints)
    assert bans_within(some.constraints.next_mask(), some.banned_token_ids()) == (0, 9)
    # No mask: bans as they are.
    assert bans_within(None, (0, 9)) == (0, 9)
    assert _request(5, TokenConstraints(bad_words=BadWords([(9,)]))).banned_token_ids() == (0, 9)


@pytest.mark.parametrize("ids", [[0], [31], [32], [63, 64, 99]])
def test_mask_edges(ids):
    assert mask_allows(token_mask(ids, VOCAB), VOCAB).tolist() == ids


class _FixedGrammar:
    def __init__(self, allowed: list[int]) -> None:
        self.mask = token_mask(allowed, VOCAB)

    def next_mask(self) -> np.ndarray:
        return self.mask


def test_allowed_token_ids_narrow_a_grammar_unless_nothing_would_be_left():
    constraints = TokenConstraints(allowed=token_mask([1, 2, 3], VOCAB))
    constraints.grammar = _FixedGrammar([2, 3, 4])  # type: ignore[assignment]
    assert mask_allows(constraints.next_mask(), VOCAB).tolist() == [2, 3]
    constraints.grammar = _FixedGrammar([7])  # type: ignore[assignment]
    assert mask_allows(constraints.next_mask(), VOCAB).tolist() == [7]
