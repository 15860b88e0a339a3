"""Tool calls the model writes in its own text, for tool_choice "auto" (--tool-call-parser).

`hermes`: Qwen2.5, Qwen3 and Hermes models write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

where `<tool_call>` and `</tool_call>` are added tokens that are not special, so they are in the
decoded text. Text outside the blocks is the message's content. A block whose JSON does not
parse as a call stays in the content as written: nothing is dropped or guessed.

`llama3_json`: Llama 3.1 to 3.3 answer with the calls alone, as JSON objects
`{"name": "get_weather", "parameters": {"city": "Paris"}}` separated by `;` (after
`<|python_tag|>`, a special token that decoding drops). An output is calls when all of it parses
as such; otherwise it is all content.

`mistral`: Mistral models (7B v0.3, Nemo, Small 2409, Mixtral 8x22B) answer with a JSON list of
calls after a `[TOOL_CALLS]` control token, `[TOOL_CALLS] [{"name": "get_weather", "arguments":
{"city": "Paris"}}]`; decoding drops the token unless special tokens are kept, so the list may
come with or without it. Mistral's chat templates take only call ids of nine letters and digits,
so the calls get such ids.

`pythonic`: Llama 3.2 and 4 (and Gemma 3 with a template that asks for it) answer with a Python
list of calls with keyword arguments, `[get_weather(city="Paris"), get_time()]`; the arguments
are Python literals (strings, numbers, True/False/None, lists, dicts). As with `llama3_json`,
an output is calls when all of it parses as such (read by `ast`, never evaluated), otherwise
all content.

Streamed, a Hermes call goes out whole once its block closes (one delta with the name and all
the arguments, which OpenAI's format allows); content goes out as it comes, except a tail that
could be the start of `<tool_call>` or is whitespace, held until the next text tells.
Whitespace right before a call, and after the last one, is not content (streamed or not).
A Llama output that starts with `{` (a pythonic one with `[`) is held to its end, then goes
out as calls or as content.

PURE: no torch, no asyncio.
"""

from __future__ import annotations

import ast
import json
import secrets
import string

from aioinfer.server.serving.tools import ToolCall, loads_or_none, new_call_id


class HermesToolParser:
    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self, single_call: bool = False) -> None:
        self.single_call = single_call  # parallel_tool_calls false: the first call only

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output's content (None when only calls) and calls: what the stream of the
        same output gives, so that both modes agree."""
        stream = self.stream()
        content, calls = stream.feed(text, final=True)
        return (content or None) if calls else content, calls

    def stream(self) -> HermesStream:
        return HermesStream(self)


class HermesStream:
    """One choice's output, fed delta by delta."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self._pending = ""  # text not yet given out
        self._in_call = False
        self._gap = ""  # the whitespace before the open block
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content to send now and the calls completed by `delta`; `final` once the
        output ended (everything held back goes out)."""
        self._pending += delta
        start, end = self.parser.start, self.parser.end
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                index = self._pending.find(start)
                if index < 0:
                    if final:  # whitespace after the last call is no content
                        text = self._pending.rstrip() if self.num_calls else self._pending
                        content.append(text)
                        self._pending = ""
                        break
                    # Held back: what may begin `<tool_call>`, and whitespace that would be
                    # dropped if a call follows it.
                    keep = partial_suffix(self._pending, start)
                    sent = self._pending[: len(self._pending) - keep].rstrip()
                    content.append(sent)
                    self._pending = self._pending[len(sent) :]
                    break
                before = self._pending[:index]
                content.append(before.rstrip())
                self._gap = before[len(before.rstrip()) :]  # dropped if the block is a call
                self._pending = self._pending[index + len(start) :]
                self._in_call = True
            index = self._pending.find(end)
            if index < 0:
                if final:  # an unterminated block: the text as written
                    content.append(self._gap + start + self._pending)
                    self._pending = ""
                break
            body, self._pending = self._pending[:index], self._pending[index + len(end) :]
            self._in_call = False
            call = _call_of(loads_or_none(body))
            if call is None:
                content.append(self._gap + start + body + end)
            elif self.parser.single_call and self.num_calls:
                continue  # a call past the first: dropped
            else:
                calls.append(call)
                self.num_calls += 1
        return "".join(content), calls


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Llama3JsonToolParser:
    opener = "{"  # how an output of calls begins

    def __init__(self, single_call: bool = False) -> None:
        self.single_call = single_call  # parallel_tool_calls false: the first call only

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output's content (None when only calls) and calls."""
        calls = self.calls(text)
        if not calls:
            return text, []
        return None, calls[:1] if self.single_call else calls

    def calls(self, text: str) -> list[ToolCall] | None:
        return _json_calls(text)

    def stream(self) -> WholeOutputStream:
        return WholeOutputStream(self)


class MistralToolParser(Llama3JsonToolParser):
    opener = "["
    marker = "[TOOL_CALLS]"

    def calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix(self.marker)
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:  # each with its arguments: [{"name": "Paris"}] is an answer
            call = _call_of(item, mistral_id()) if isinstance(item, dict) else None
            if call is None or "arguments" not in item:
                return None
            calls.append(call)
        return calls


def mistral_id() -> str:
    """A call id as Mistral's templates require: nine letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class PythonicToolParser(Llama3JsonToolParser):
    opener = "["

    def calls(self, text: str) -> list[ToolCall] | None:
        return _pythonic_calls(text)


class Phi4MiniJsonToolParser(Llama3JsonToolParser):
    """Phi-4-mini's calls: `functools` and a JSON list of {"name", "arguments"} objects."""

    opener = "functools["

    def calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip()
        if not text.startswith(self.opener):  # as a stream decides
            return None
        try:
            value = json.loads(text.removeprefix("functools"))
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            call = _call_of(item)
            if call is None:  # one item that is no call: the whole output is content
                return None
            calls.append(call)
        return calls


class WholeOutputStream:
    """One choice's output, fed delta by delta, for parsers that read a whole output as calls
    or as content: one that begins with the parser's opener is held to its end."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self.parser = parser
        self._pending = ""
        self._json: bool | None = None  # whether the output starts with `{`; None: not known
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if self._json is False:
            return delta, []
        self._pending += delta
        if self._json is None:
            head, opener = self._pending.lstrip(), self.parser.opener
            # Undecided while what came may still begin the opener ("func" of "functools[").
            if not final and len(head) < len(opener) and opener.startswith(head):
                return "", []
            self._json = head.startswith(opener)
            if not self._json:
                text, self._pending = self._pending, ""
                return text, []
        if not final:
            return "", []
        content, calls = self.parser.parse(self._pending)
        self._pending, self.num_calls = "", len(calls)
        return content or "", calls


def _json_calls(text: str) -> list[ToolCall] | None:
    """The calls of a text that is only call objects separated by whitespace or `;`; None
    for anything else."""
    decoder = json.JSONDecoder()
    text = text.strip()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        # A call always has its arguments in this format: {"name": "Paris"} is an answer.
        has_arguments = isinstance(value, dict) and ("parameters" in value or "arguments" in value)
        call = _call_of(value) if has_arguments else None
        if call is None:
            return None
        calls.append(call)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """The calls of a text that is only a Python list of calls with keyword arguments whose
    values are literals; None for anything else. Parsed, never evaluated."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[ToolCall] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        names = [node.func.id, *(kw.arg for kw in node.keywords)]
        # No **splat, no repeated keyword, and names as written: Python reads identifiers
        # NFKC-normalised ("ﬁnd" as "find").
        if None in names or len(set(names[1:])) < len(names) - 1:
            return None
        if any(str(name) not in text for name in names):
            return None
        try:  # tuples become lists; sets and bytes are no JSON: not a call
            arguments_text = _arguments_json(
                {str(kw.arg): ast.literal_eval(kw.value) for kw in node.keywords}
            )
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if arguments_text is None:
            return None
        calls.append(ToolCall(new_call_id(), node.func.id, arguments_text))
    return calls


def _arguments_json(arguments: dict[str, object]) -> str | None:
    """The arguments as JSON text, or None where they are no JSON for the client: NaN or
    Infinity, or a lone surrogate from an escape such as "\\ud800" (a pair, which Python
    keeps as two halves where JSON reads one character, is joined)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        return text.encode("utf-16", "surrogatepass").decode("utf-16")
    except (ValueError, TypeError):  # UnicodeError is a ValueError
        return None


def _call_of(value: object, call_id: str | None = None) -> ToolCall | None:
    """The call a parsed JSON value is; None unless it is {"name": str, "arguments": an
    object} (arguments may also be "parameters", the object's JSON text, or absent or null
    for none). `call_id`: the call's id (a new one by default)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        arguments = loads_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    text = _arguments_json(arguments)
    return None if text is None else ToolCall(call_id or new_call_id(), value["name"], text)


ToolParser = HermesToolParser | Llama3JsonToolParser
ToolCallStream = HermesStream | WholeOutputStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
}


def make_tool_parser(name: str | None, *, parallel: bool = True) -> ToolParser | None:
    """The parser --tool-call-parser names (ServerConfig checked the name); without
    `parallel` (parallel_tool_calls false) it keeps the first call only, as vLLM does."""
    return None if name is None else TOOL_PARSERS[name](single_call=not parallel)
