"""Beam search's pure part: the score that ranks beams, one step of the search, the params."""

from __future__ import annotations

import pytest

from aioinfer.core.beam_search import (
    BeamSearchInstance,
    BeamSearchParams,
    BeamSearchSequence,
    beam_score,
)
from aioinfer.core.step import Logprob

EOS = frozenset({2})


def position(**logprobs: float) -> dict[int, Logprob]:
    """Candidates written as t<id>=logprob."""
    return {int(k[1:]): Logprob(v, rank) for rank, (k, v) in enumerate(logprobs.items(), 1)}


def test_the_score_divides_by_the_length_without_a_final_eos():
    beam = BeamSearchSequence([5, 6, 7, 8], cum_logprob=-2.0)
    assert beam_score(beam, EOS, 1.0) == -0.5
    assert beam_score(beam, EOS, 0.0) == -2.0
    assert beam_score(BeamSearchSequence([5, 6, 7, 2], cum_logprob=-2.0), EOS, 1.0) == -2.0 / 3


def test_a_step_keeps_the_best_beam_width_and_finishes_at_eos():
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    search = BeamSearchInstance([BeamSearchSequence([9], cum_logprob=-1.0),
                                 BeamSearchSequence([8], cum_logprob=-3.0)])  # fmt: skip
    search.extend([position(t10=-0.5, t2=-0.1, t11=-2.0), position(t12=-0.1)], params, EOS, 64)
    assert [b.tokens for b in search.beams] == [[9, 10], [9, 11]]  # -1.5 and -3.0 beat -3.1
    assert [b.cum_logprob for b in search.beams] == [-1.5, -3.0]
    [done] = search.completed
    assert (done.tokens, done.finish_reason, done.stop_reason) == ([9, 2], "stop", 2)
    assert search.beams[0].logprobs[0][10].logprob == -0.5
    # The finished beam (score -1.1 over one token) outranks the live ones (-0.75, -1.5).
    best = search.best(params, EOS)
    assert [b.tokens for b in best] == [[9, 10], [9, 2]]
    assert best[0].finish_reason == "length"


def test_ignore_eos_keeps_eos_beams_live_and_the_context_ends_a_beam():
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    search = BeamSearchInstance([BeamSearchSequence([9])])
    search.extend([position(t2=-0.1, t3=-0.2)], params, EOS, 64)
    assert [b.tokens for b in search.beams] == [[9, 2], [9, 3]] and not search.completed
    short = BeamSearchInstance([BeamSearchSequence([9])])
    short.extend([position(t4=-0.1)], params, EOS, 2)  # two tokens: the whole context
    assert not short.beams and short.completed[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("options", "fragment"),
    [({"beam_width": 0}, "beam_width"), ({"max_tokens": 1.5}, "max_tokens"),
     ({"temperature": -1}, "temperature"), ({"length_penalty": float("nan")}, "length_penalty"),
     ({"beam_width": True}, "beam_width")],
)  # fmt: skip
def test_bad_params_name_the_field(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **options})
