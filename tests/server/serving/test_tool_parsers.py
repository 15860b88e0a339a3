"""The tool-call parsers (hermes, llama3_json): whole outputs, and the same outputs streamed in
any pieces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioinfer.config import TOOL_CALL_PARSER_NAMES
from aioinfer.server.serving.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Phi4MiniJsonToolParser,
    PythonicToolParser,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
SECOND = '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
BROKEN = "<tool_call>{not json}</tool_call>"


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_whole_outputs():
    parser = HermesToolParser()
    assert parser.parse("No tools needed.") == ("No tools needed.", [])
    content, calls = parser.parse("Checking.\n" + CALL + "\n" + SECOND)
    assert content == "Checking."
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    content, calls = parser.parse(CALL)
    assert content is None and len(calls) == 1
    # What does not parse as a call stays as written.
    assert parser.parse("a " + BROKEN) == ("a " + BROKEN, [])
    # Whitespace before a call and after the last one is not content; text after one is.
    assert parser.parse("Sure. " + CALL + "\n" + SECOND + "\n")[0] == "Sure."
    assert parser.parse(CALL + "\n Done.")[0] == "\n Done."
    assert parser.parse("a <tool_call>{") == ("a <tool_call>{", [])
    content, calls = parser.parse(BROKEN + CALL)
    assert content == BROKEN and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"
    assert parser.parse(deep) == (deep, [])  # past the recursion limit: text, not a 500


def test_arguments_are_always_an_object_s_json():
    parser = HermesToolParser()

    def arguments(value: str) -> list[str]:
        _, calls = parser.parse('<tool_call>{"name": "f"' + value + "}</tool_call>")
        return [c.arguments for c in calls]

    assert arguments(', "arguments": {"x": 1}') == ['{"x": 1}']
    assert arguments(', "arguments": "{\\"x\\": 1}"') == ['{"x": 1}']
    assert arguments(', "arguments": null') == ["{}"]
    assert arguments("") == ["{}"]
    assert arguments(', "parameters": {"y": 2}') == ['{"y": 2}']
    # Not an object: the block stays in the content, as written.
    for value in (', "arguments": "Oslo"', ', "arguments": [1]', ', "arguments": 3'):
        assert arguments(value) == []


TEXTS = [
    "Checking.\n" + CALL + "\n" + SECOND,
    "plain text with < and <tool and </tool_call> but no call",
    "x" + BROKEN + CALL + " tail <tool_ca",
    CALL + "<tool_call>{unterminated",
    "Let me check. " + CALL + "\n" + SECOND + "\n",
    "  lead \n" + CALL + " Done.\n",
    "a \n" + BROKEN + "\n" + CALL + "\n <tool_call>{x",
    "ends in blanks  \n\n",
]


@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_streaming_in_any_pieces_gives_the_whole_output(text, cuts):
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    stream = HermesToolParser().stream()
    content, calls = "", []
    for i, piece in enumerate(pieces):
        out, done = stream.feed(piece, final=i == len(pieces) - 1)
        content += out
        calls += done
        # Nothing that could begin a call goes out before the text decides.
        assert not out.endswith("<tool_cal")
    whole_content, whole_calls = HermesToolParser().parse(text)
    assert _calls(calls) == _calls(whole_calls)
    assert content == (whole_content or "")  # the same text, to the whitespace
    assert stream.num_calls == len(whole_calls)


def test_the_config_knows_every_parser():
    assert set(TOOL_CALL_PARSER_NAMES) == set(TOOL_PARSERS)


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
LLAMA_TEXTS = [
    LLAMA_CALL,
    " " + LLAMA_CALL + '; {"name": "get_time", "parameters": {}}',
    '{"name": "Paris"}',  # no arguments: an answer that happens to be JSON
    LLAMA_CALL + " and some words",
    "The weather is fine. " + LLAMA_CALL,
    '{"name": "f", "parameters": [1]}',
    '{"name": "f", "parameters": {"c": "\\ud800"}}',  # a lone surrogate is no JSON to send
    "{" * 3000,
    "",
]


def test_llama3_json_whole_outputs():
    parser = Llama3JsonToolParser()
    content, calls = parser.parse(LLAMA_CALL)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    content, calls = parser.parse(LLAMA_TEXTS[1])
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert parser.parse('{"name": "f", "arguments": "{\\"x\\": 1}"}')[1][0].arguments == '{"x": 1}'
    # Anything but calls alone is content, as written.
    for text in LLAMA_TEXTS[2:]:
        assert parser.parse(text) == (text, [])


MISTRAL_CALL = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
MISTRAL_TEXTS = [
    MISTRAL_CALL,
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": {}}]',  # special tokens kept
    '[{"name": "Paris"}]',  # no arguments: an answer that happens to be JSON
    "[1, 2, 3]",
    "[]",
    MISTRAL_CALL + " and some words",
    "[See the docs](https://example.com)",
    "[" * 3000,
    "",
]


def test_mistral_whole_outputs_and_call_ids():
    parser = MistralToolParser()
    content, calls = parser.parse(" " + MISTRAL_CALL)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    content, calls = parser.parse(MISTRAL_TEXTS[1])
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    # Mistral's templates refuse any other call id than nine letters and digits.
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert calls[0].id != calls[1].id
    for text in MISTRAL_TEXTS[2:]:
        assert parser.parse(text) == (text, [])


PYTHONIC_CALL = '[get_weather(city="Oslo", days=3, units=None, when=["mon", 1.5], x={"a": True})]'
PYTHONIC_TEXTS = [
    PYTHONIC_CALL,
    ' [get_weather(city="Oslo"), get_time()]\n',
    "[1, 2, 3]",  # a list, no calls: an answer
    '[get_weather("Oslo")]',  # positional arguments are not the format
    "[get_weather(**kwargs)]",
    "[get_weather(city=os.system('x'))]",  # not a literal: never evaluated
    "[get_weather(city={1, 2})]",  # a set is no JSON
    "[f(x=float('nan'))]",
    "[]",
    '[get_weather(city="\\ud800")]',  # a lone surrogate
    "[f(a=1, a=2)]",  # a repeated keyword
    "[\ufb01nd(x=1)]",  # Python would read the name as "find"
    '[get_weather(city="Oslo")] and more',
    "The answer: [get_time()]",
    "[" * 3000,
    "",
]


def test_pythonic_whole_outputs():
    parser = PythonicToolParser()
    content, calls = parser.parse(PYTHONIC_CALL)
    expected = {"city": "Oslo", "days": 3, "units": None, "when": ["mon", 1.5], "x": {"a": True}}
    assert content is None and _calls(calls) == [("get_weather", expected)]
    content, calls = parser.parse(PYTHONIC_TEXTS[1])
    assert content is None and _calls(calls) == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert parser.parse("[f(t=(1, 2))]")[1][0].arguments == '{"t": [1, 2]}'  # tuples: lists
    # An escaped pair is one character, as JSON reads it (Python keeps two halves).
    pair = '[f(c="\\ud83d\\ude00")]'
    assert parser.parse(pair)[1][0].arguments == '{"c": "\U0001f600"}'
    assert (
        Llama3JsonToolParser()
        .parse('{"name": "f", "parameters": {"c": "\\ud83d\\ude00"}}')[1][0]
        .arguments
        == '{"c": "\U0001f600"}'
    )
    for text in PYTHONIC_TEXTS[2:]:  # anything but calls alone is content, as written
        assert parser.parse(text) == (text, [])
    assert len(PythonicToolParser(single_call=True).parse(PYTHONIC_TEXTS[1])[1]) == 1


PHI4_CALL = 'functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
PHI4_TEXTS = [
    PHI4_CALL,
    ' functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time",'
    ' "arguments": {}}]\n',
    "functools[]",  # no calls
    'functools[{"name": "f"}, 3]',  # an item that is no call
    "functools are handy",  # begins like the opener: an answer
    'functools [{"name": "f", "arguments": {}}]',  # not the opener
    "func",
    "The answer: functools[]",
    'functools[{"name": "f", "arguments": {}}] and more',
    "",
]


def test_phi4_mini_whole_outputs():
    parser = Phi4MiniJsonToolParser()
    content, calls = parser.parse(PHI4_CALL)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    content, calls = parser.parse(PHI4_TEXTS[1])
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for text in PHI4_TEXTS[2:]:
        assert parser.parse(text) == (text, [])


@pytest.mark.parametrize(
    ("parser", "texts"),
    [
        (Llama3JsonToolParser, LLAMA_TEXTS),
        (MistralToolParser, MISTRAL_TEXTS),
        (PythonicToolParser, PYTHONIC_TEXTS),
        (Phi4MiniJsonToolParser, PHI4_TEXTS),
    ],
)
@given(data=st.data(), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_whole_output_parsers_streamed_in_any_pieces_give_the_whole_output(
    parser, texts, data, cuts
):
    text = data.draw(st.sampled_from(texts))
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    stream = parser().stream()
    content, calls = "", []
    for i, piece in enumerate(pieces):
        out, done = stream.feed(piece, final=i == len(pieces) - 1)
        content += out
        calls += done
    whole_content, whole_calls = parser().parse(text)
    assert _calls(calls) == _calls(whole_calls)
    assert content == (whole_content or "")
    assert stream.num_calls == len(whole_calls)


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    """As vLLM does for tool_choice auto; the dropped calls do not become content."""
    two_hermes = "Both.\n" + CALL + "\n" + SECOND
    two_llama = LLAMA_TEXTS[1]
    for make, text in ((HermesToolParser, two_hermes), (Llama3JsonToolParser, two_llama)):
        assert len(make().parse(text)[1]) == 2
        content, calls = make(single_call=True).parse(text)
        assert _calls(calls) == [("get_weather", {"city": "Oslo"})]
        assert content in (None, "Both.")
        stream = make(single_call=True).stream()
        streamed = [c for piece in text for c in stream.feed(piece)[1]]
        streamed += stream.feed("", final=True)[1]
        assert _calls(streamed) == _calls(calls) and stream.num_calls == 1
