"""The reasoning split (--reasoning-parser) and the gate that holds a grammar back while the
model reasons, without a model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioinfer.config import REASONING_PARSER_NAMES
from aioinfer.core.constraints import ConstraintBuilder, mask_allows, with_reasoning_gate
from aioinfer.core.request import Request
from aioinfer.core.sampling_params import SamplingParams, StructuredOutputsParams
from aioinfer.server.serving.reasoning import REASONING_PARSERS, ReasoningSplit, continued_text
from tests.support.tokenizers import make_tokenizer


def test_the_config_knows_every_parser():
    assert set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)


@pytest.mark.parametrize(
    ("opened", "text", "reasoning", "answer"),
    [
        (False, "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        (False, "Paris.", None, "Paris."),  # thinking off: no block
        (False, "  Paris, <think> is text here", None, "  Paris, <think> is text here"),
        (False, "<thinking>x</thinking>", None, "<thinking>x</thinking>"),
        (False, "<think>\nStill thinking when max_tokens", "Still thinking when max_tokens", ""),
        (False, "<think></think>\n\nParis.", None, "Paris."),
        (True, "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        (True, "<think>\nAgain the tag.</think>Paris.", "Again the tag.", "Paris."),
        (True, "No end tag", "No end tag", ""),
        (False, "<think>a</think>b</think>c", "a", "b</think>c"),  # one block only
    ],
)
def test_a_whole_output_splits_into_reasoning_and_answer(opened, text, reasoning, answer):
    assert ReasoningSplit(opened, include=True).parse(text) == (reasoning, answer)


PIECES = st.sampled_from(
    ["<think>", "</think>", "<th", "ink>", "</", "think", ">", "\n", " ", "a", "b c", "<", "/"]
)


@given(st.booleans(), st.lists(PIECES, max_size=14), st.data())
def test_a_streamed_output_splits_as_the_whole_one_does(opened, pieces, data):
    """Whatever the deltas, their reasoning and answer add up to the whole output's."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    split = ReasoningSplit(opened, include=True)
    stream = split.stream()
    reasoning, answer = "", ""
    for i, delta in enumerate(deltas):
        r, a = stream.feed(delta, final=i == len(deltas) - 1)
        reasoning, answer = reasoning + r, answer + a
    whole_reasoning, whole_answer = split.parse(text)
    assert (reasoning or None, answer) == (whole_reasoning, whole_answer)


def test_parsers_differ_in_where_the_output_starts():
    tokenizer = make_tokenizer()
    plain = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    opening = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    assert not qwen3.split(plain, tokenizer, include=True).opened
    assert qwen3.split(opening, tokenizer, include=True).opened
    assert r1.split(plain, tokenizer, include=True).opened


# ---- the gate: a grammar waits while the model reasons


def _choice_constraints():
    """A real grammar ("yes" or "no") over the test tokenizer, and two ids that stand for
    `<think>` and `</think>` (neither may start the grammar's output)."""
    tokenizer = make_tokenizer()
    builder = ConstraintBuilder(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = StructuredOutputsParams(choice=["yes", "no"])
    factory = builder.prepare(SamplingParams(structured_outputs=spec, max_tokens=8))
    assert factory is not None
    first = set(mask_allows(factory().next_mask(), len(tokenizer)).tolist())
    start, end = [t for t in range(10, len(tokenizer)) if t not in first][:2]
    return tokenizer, factory, first, start, end


def _allowed(constraints, vocab):
    mask = constraints.next_mask()
    return None if mask is None else set(mask_allows(mask, vocab).tolist())


def test_the_grammar_waits_for_the_end_of_the_reasoning():
    tokenizer, factory, first, start, end = _choice_constraints()
    vocab = len(tokenizer)
    constraints = with_reasoning_gate(factory, start, end, opened=False)()
    assert _allowed(constraints, vocab) == first | {start}  # answer, or open the reasoning
    constraints.accept(start)
    for token in tokenizer.encode("any text, not yes or no", add_special_tokens=False):
        assert _allowed(constraints, vocab) is None  # free while reasoning
        constraints.accept(token)
    constraints.accept(end)
    assert _allowed(constraints, vocab) == first  # the grammar from its start
    for token in tokenizer.encode("no", add_special_tokens=False):
        constraints.accept(token)
    assert not constraints.grammar.rejected


def test_an_opened_block_frees_the_output_from_its_first_token():
    tokenizer, factory, first, start, end = _choice_constraints()
    constraints = with_reasoning_gate(factory, start, end, opened=True)()
    assert _allowed(constraints, len(tokenizer)) is None
    constraints.accept(end)
    assert _allowed(constraints, len(tokenizer)) == first


def test_an_answer_without_reasoning_is_constrained_from_its_first_token():
    tokenizer, factory, _, start, end = _choice_constraints()
    constraints = with_reasoning_gate(factory, start, end, opened=False)()
    for token in tokenizer.encode("yes", add_special_tokens=False):
        constraints.accept(token)
    # The grammar took "yes" (else it could not end here), and the start tag is no longer let in.
    assert start not in (_allowed(constraints, len(tokenizer)) or ())
    constraints.accept(tokenizer.eos_token_id)
    assert constraints.grammar_done and not constraints.grammar.rejected


class _TagVocab:
    """A tokenizer stand-in: `<think>` and `</think>` single tokens or not."""

    def __init__(self, single: bool) -> None:
        self.single = single

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if text in ("<think>", "</think>") and self.single:
            return [7 if text == "<think>" else 8]
        return list(range(1, len(text.split()) + 3))

    def decode(self, ids: list[int]) -> str:
        return "x"


def test_the_gate_needs_the_tags_as_single_tokens():
    _, factory, _, _, _ = _choice_constraints()
    split = REASONING_PARSERS["deepseek_r1"].split([1], _TagVocab(single=False), include=True)
    assert split.tags is None
    assert split.gate(factory) is factory
    split = REASONING_PARSERS["deepseek_r1"].split([1], _TagVocab(single=True), include=True)
    gated = split.gate(factory)()
    assert gated.reasoning is not None
    assert (gated.reasoning.start_id, gated.reasoning.end_id) == (7, 8)


def test_the_output_may_not_end_while_its_grammar_waits():
    """EOS and stop_token_ids are banned while the model reasons under a held-back grammar
    (it must close the block, or max_tokens ends it); after `</think>` the grammar decides."""
    tokenizer, factory, _, start, end = _choice_constraints()
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_tokens=10, stop_token_ids=[5])
    constraints = with_reasoning_gate(factory, start, end, opened=True)()
    request = Request("r", [1, 2], params, max_tokens=10, eos_token_ids=frozenset({eos}),
                      constraints=constraints)  # fmt: skip
    assert set(request.banned_token_ids()) == {5, eos}
    constraints.accept(end)
    assert request.banned_token_ids() == ()
    # Without a grammar nothing waits: no bans.
    plain = Request("p", [1, 2], params, max_tokens=10, eos_token_ids=frozenset({eos}))
    assert plain.banned_token_ids() == ()


def test_a_named_call_needs_arguments_and_arguments_need_json():
    """A named tool_choice whose model only reasoned makes no call (streamed or not), and
    NaN, which Python parses, is no JSON argument."""
    from aioinfer.server.serving.tool_parsers import HermesToolParser
    from aioinfer.server.serving.tools import ToolMode

    assert ToolMode(named="f").calls("") is None
    assert ToolMode(named="f").calls('{"x": 1}') is not None
    text = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    assert HermesToolParser().parse(text) == (text, [])


def _counted(opened: bool, token_ids: list[int], pieces: int = 1) -> int:
    """reasoning_tokens of an output fed in `pieces` deltas; ids 7 and 8 are the tags, 0 is
    whitespace."""
    split = ReasoningSplit(opened=opened, include=True, tags=(7, 8))
    counter = split.counter(lambda t: " " if t == 0 else f"t{t}")
    step = max(1, -(-len(token_ids) // pieces))
    for i in range(0, len(token_ids), step):
        counter.feed(token_ids[i : i + step])
    return counter.count


@pytest.mark.parametrize("pieces", [1, 3, 10])
def test_reasoning_tokens_are_those_between_the_tags(pieces):
    assert _counted(False, [7, 1, 2, 3, 8, 4, 5], pieces) == 3
    assert _counted(False, [0, 0, 7, 1, 8, 4], pieces) == 1  # whitespace before `<think>`
    assert _counted(False, [4, 7, 1, 8, 5], pieces) == 0  # not at the start: an answer
    assert _counted(True, [1, 2, 8, 4, 7, 5, 8], pieces) == 2  # the prompt opened the block
    assert _counted(True, [1, 2, 3], pieces) == 3  # cut short while thinking
    assert _counted(True, [8, 4, 5], pieces) == 0


@pytest.mark.parametrize("pieces", [1, 4, 100])
def test_reasoning_tokens_without_single_token_tags_follow_the_text_split(pieces):
    """Tags of several tokens: the tokens fed while the text split is inside the block, one
    token at a time, so a whole and a streamed output count the same."""
    tokenizer = make_tokenizer()
    split = REASONING_PARSERS["qwen3"].split([1], tokenizer, include=False)
    assert split.tags is None
    ids = tokenizer.encode("<think>They greet me.</think>Hello!", add_special_tokens=False)
    counter = split.counter(lambda t: tokenizer.decode([t]))
    step = max(1, -(-len(ids) // pieces))
    for i in range(0, len(ids), step):
        counter.feed(ids[i : i + step])
    inside = len(tokenizer.encode("They greet me.", add_special_tokens=False))
    assert (
        inside
        <= counter.count
        < len(ids) - len(tokenizer.encode("Hello!", add_special_tokens=False))
    )


@pytest.mark.parametrize(
    ("parser", "continued", "opened"),
    [
        ("qwen3", None, False),
        ("qwen3", "<think>\nLet me see", True),
        ("qwen3", "<think>a</think>The answer", False),
        ("qwen3", "Sure", False),
        ("deepseek_r1", None, True),
        ("deepseek_r1", "Let me see", True),  # R1's block opens in its prompt
        ("deepseek_r1", "a</think>The answer", False),
        ("deepseek_r1", "<think>a</think>b<think>c", False),  # a literal tag in the answer
        ("qwen3", "What does <think> mean?", False),
        ("qwen3", "The tag is <think>", False),
        ("qwen3", "  <think>\nstill thinking", True),
    ],
)
def test_a_continued_message_decides_whether_the_block_is_open(parser, continued, opened):
    split = REASONING_PARSERS[parser].split(
        [5, 6], make_tokenizer(), include=True, continued=continued
    )
    assert split.opened is opened


def test_continued_text_reads_strings_and_text_parts():
    assert continued_text([{"role": "assistant", "content": "<think>x"}]) == "<think>x"
    parts = [{"type": "text", "text": "<think>"}, {"type": "text", "text": "y"}]
    assert continued_text([{"role": "assistant", "content": parts}]) == "<think>y"
    assert continued_text([]) is None
    assert continued_text([{"role": "user", "content": "<think>"}]) is None


def test_a_tag_written_again_inside_an_open_block_is_not_reasoning():
    assert _counted(True, [7, 1, 8, 4]) == 1
    assert _counted(True, [0, 7, 1, 2, 8]) == 3  # the whitespace is inside the open block
