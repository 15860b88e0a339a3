"""A sequence's tokens as the scheduler reads them: its prompt, shared with the other sequences
of its request, then its own output."""

from __future__ import annotations

import random

import pytest

from aioinfer.core.request import Request, TokenIds
from aioinfer.core.sampling_params import SamplingParams


def test_token_ids_read_as_the_prompt_then_the_output():
    rng = random.Random(0)
    for num_prompt, num_output in ((1, 0), (5, 0), (5, 3), (16, 40)):
        prompt = tuple(rng.randrange(100) for _ in range(num_prompt))
        output = [rng.randrange(100) for _ in range(num_output)]
        tokens, whole = TokenIds(prompt, output), [*prompt, *output]
        assert len(tokens) == len(whole) and list(tokens) == whole
        for i in range(-len(whole), len(whole)):
            assert tokens[i] == whole[i]
        for index in (len(whole), -len(whole) - 1):
            with pytest.raises(IndexError):
                tokens[index]
        for _ in range(200):
            start, stop = rng.randrange(-60, 60), rng.randrange(-60, 60)
            step = rng.choice((None, 1, 2, -1))
            assert tokens[start:stop:step] == tuple(whole[start:stop:step])
        assert tokens[:] == tuple(whole)


def test_the_sequences_of_a_request_share_its_prompt_and_grow_their_own_outputs():
    prompt = tuple(range(5, 1005))
    params = SamplingParams(max_tokens=4)
    first, second = (Request(f"r-{i}", prompt, params, max_tokens=4) for i in range(2))
    assert first.prompt_token_ids is prompt and second.prompt_token_ids is prompt
    first.append_output(7)
    assert first.num_tokens == 1001 and first.all_token_ids[-2:] == (1004, 7)
    assert second.num_tokens == 1000 and second.output_token_ids == []
    # A list is copied once, into the tuple.
    listed = Request("r", list(prompt), params, max_tokens=4)
    assert listed.prompt_token_ids == prompt and listed.all_token_ids[:] == prompt
