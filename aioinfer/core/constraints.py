"""What a request may sample next: allowed_token_ids, bad_words and structured outputs.

Masks are bitmasks, int32 [ceil(V / 32)] with bit i % 32 of word i // 32 set for an allowed
token i (xgrammar's layout, so a grammar fills one in place). The scheduler asks each sampling
request for its bans (`banned()`) when it builds a step and hands the sampler its
`TokenConstraints`, whose `next_mask()` the sampler calls on the runner thread and turns into
-inf logits. Grammars advance in `accept()` when a token is appended.

Bans (min_tokens, bad words) never leave a row with nothing to sample: where a mask allows
only banned tokens (a finished JSON document allows only EOS), the mask wins. Structured
outputs use xgrammar (imported on first use): JSON without free whitespace, so that a model
cannot pad a document with spaces up to max_tokens.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from aioinfer.core.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

MASK_BITS = 32
GRAMMAR_CACHE_BYTES = 512 * 1024 * 1024  # vLLM's default for its xgrammar cache
MAX_PATTERN_NESTING = 200


def mask_width(vocab_size: int) -> int:
    return (vocab_size + MASK_BITS - 1) // MASK_BITS


def token_mask(token_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """The int32 bitmask [W] that allows exactly `token_ids`."""
    allowed = np.zeros(mask_width(vocab_size) * MASK_BITS, dtype=bool)
    allowed[list(token_ids)] = True
    return np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32)


def mask_allows(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids of the tokens an int32 bitmask [W] allows."""
    bits = np.unpackbits(mask.astype("<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def bans_within(mask: np.ndarray | None, banned: Sequence[int]) -> Sequence[int]:
    """`banned`, or none of them where `mask` allows nothing else: bans never leave a row with
    nothing to sample."""
    if mask is None or not banned or allows_any_besides(mask, banned):
        return banned
    return ()


def allows_any_besides(mask: np.ndarray, banned: Sequence[int]) -> bool:
    """Whether `mask` allows a token that is not in `banned`."""
    remaining = mask.view(np.uint32).copy()
    for token in banned:
        word, bit = divmod(token, MASK_BITS)
        if word < remaining.shape[0]:
            remaining[word] &= np.uint32(0xFFFFFFFF ^ (1 << bit))
    return bool(remaining.any())


# ---------------------------------------------------------------------------- bad words


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> list[tuple[int, ...]]:
    """Each word's tokens as it would start the text and, where that differs, after a space
    (vLLM's rule: the spaced form counts when it is as long and starts with another token)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain and len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    return [s for s in sequences if s]


class BadWords:
    """Bans the last token of a bad word once the output ends with the rest of it."""

    def __init__(self, sequences: Sequence[tuple[int, ...]]) -> None:
        self.single = tuple(sorted({s[0] for s in sequences if len(s) == 1}))
        self.multi = [s for s in sequences if len(s) > 1]

    def banned_after(self, output_ids: Sequence[int]) -> list[int]:
        banned = list(self.single)
        for seq in self.multi:
            prefix = seq[:-1]
            if len(output_ids) >= len(prefix) and tuple(output_ids[-len(prefix) :]) == prefix:
                banned.append(seq[-1])
        return banned


# ---------------------------------------------------------------------------- grammars


class InvalidGrammarError(ValueError):
    """A structured-output spec that does not compile; `kind` names its field."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"structured_outputs.{kind} is invalid: {detail}")
        self.kind = kind
        self.detail = detail


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer; compiled grammars are cached by
    xgrammar, so repeated schemas cost nothing after the first."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        self.vocab_size = vocab_size
        # Compiles may run at once on worker threads (as vLLM's do). The cache keeps each
        # distinct spec's grammar; bounded, as a client may send endless distinct schemas.
        self._compiler = xgrammar.GrammarCompiler(
            info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES
        )

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """Raises InvalidGrammarError naming the field when the spec does not compile."""
        if spec.json is not None:
            schema = _parsed(spec.json)
            _check_patterns(schema)
            _check_enforceable(schema)
        try:
            return self._compile(spec)
        except RecursionError:
            raise InvalidGrammarError(spec.kind, "it nests too deeply") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            text = str(exc).strip()
            # xgrammar prefixes its messages with a time and a source location.
            detail = text.splitlines()[0].split(": ", 1)[-1] if text else repr(exc)
            detail = detail.split(" is false: ", 1)[-1]  # a failed internal check's condition
            raise InvalidGrammarError(spec.kind, detail) from None

    def _compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else {"type": "object"}
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return compiler.compile_json_schema(text, any_whitespace=False)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            alternatives = " | ".join(_ebnf_string(c) for c in spec.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        assert spec.grammar is not None
        return compiler.compile_grammar(spec.grammar)

    def state(self, compiled: xgrammar.CompiledGrammar) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size)


# JSON Schema keywords the grammar compiler accepts but does not enforce (it drops them with a
# warning in its log): a schema using one would be broken by the output it allows, so it is
# refused (vLLM falls back to another backend instead). `uniqueItems` is let through unenforced:
# pydantic writes it for every set field, whose parsing drops duplicates anyway.
_UNENFORCED_KEYWORDS = (
    "not", "if", "then", "else", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef",
)  # fmt: skip
# Where a schema holds subschemas: one, a list of them, or a mapping of names to them.
_ONE_SUBSCHEMA = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties",
                  "unevaluatedItems")  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _parsed(schema: Any) -> Any:
    """A schema given as JSON text, parsed (the compiler reports text that does not parse)."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except (ValueError, RecursionError):
        return None


def _check_enforceable(schema: Any) -> None:
    """Refuse a schema that uses a keyword the grammar would not enforce (names and values
    under `properties`, `enum`, `const` and the like are data, not keywords)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        used = [k for k in _UNENFORCED_KEYWORDS if k in node]
        if "multipleOf" in node and _multiple_of_dropped(node):
            used.append("multipleOf (enforced on integers only, with no bounds or both)")
        if any(k in node for k in ("pattern", "format")) and any(
            k in node for k in ("minLength", "maxLength")
        ):
            used.append("minLength or maxLength together with a pattern or format")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            used.append("allOf (with more than one schema)")
        ref = node.get("$ref")
        if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            used.append(f"$ref to anything but a path in this document ({ref!r})")
        if used:
            raise InvalidGrammarError(
                "json", f"the schema uses {used[0]}, which structured outputs cannot enforce"
            )
        stack.extend(node[k] for k in _ONE_SUBSCHEMA if k in node)
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())


def _multiple_of_dropped(node: dict[str, Any]) -> bool:
    """Whether the grammar drops this node's multipleOf: it keeps it only for an integer step
    on an integer with no bounds or bounds on both sides."""
    step = node["multipleOf"]
    if node.get("type") != "integer" or not isinstance(step, int) or isinstance(step, bool):
        return True
    lower = "minimum" in node or "exclusiveMinimum" in node
    upper = "maximum" in node or "exclusiveMaximum" in node
    return lower != upper


def _check_patterns(schema: Any) -> None:
    """Refuse schemas whose regular expressions nest too deeply: xgrammar converts a schema's
    `pattern` recursively, and 30000 nested groups overflow the stack (the process dies),
    where a regex spec of the same depth gets its own error."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and _nesting(node) > MAX_PATTERN_NESTING:
            raise InvalidGrammarError(
                "json", f"a string nests more than {MAX_PATTERN_NESTING} brackets deep"
            )


def _nesting(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(0, depth - 1)
    return deepest


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal: JSON's escapes are a subset of the grammar's."""
    return json.dumps(text, ensure_ascii=False)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.rejected = False

    def next_mask(self) -> np.ndarray:
        mask = np.zeros((1, mask_width(self.vocab_size)), dtype=np.int32)
        self._matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            self.rejected = True

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


# ---------------------------------------------------------------------------- per request


class ReasoningGate:
    """Holds a grammar back while the model reasons (a server's --reasoning-parser): the
    output is free from its start, or from a first `start_id`, up to `end_id`; the grammar
    constrains what follows. So a thinking model thinks, then answers in the schema."""

    def __init__(self, start_id: int, end_id: int, *, opened: bool) -> None:
        self.start_id = start_id
        self.end_id = end_id
        # "start": the first token may open the reasoning; "reasoning"; "answer".
        self.state = "reasoning" if opened else "start"

    def accept(self, token_id: int) -> bool:
        """Takes a sampled token; whether the grammar takes it too."""
        if self.state == "answer":
            return True
        if self.state == "start":
            self.state = "reasoning" if token_id == self.start_id else "answer"
            return self.state == "answer"
        if token_id == self.end_id:
            self.state = "answer"
        return False


class TokenConstraints:
    """Everything that limits one sequence's next token besides the stop rules."""

    def __init__(
        self,
        *,
        allowed: np.ndarray | None = None,
        bad_words: BadWords | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        self.allowed = allowed
        self.bad_words = bad_words
        self.grammar = grammar
        self.reasoning: ReasoningGate | None = None

    def next_mask(self) -> np.ndarray | None:
        gate = self.reasoning
        if self.grammar is None or (gate is not None and gate.state == "reasoning"):
            return self.allowed
        mask = self.grammar.next_mask()
        if gate is not None and gate.state == "start":  # or open the reasoning
            word, bit = divmod(gate.start_id, MASK_BITS)
            mask.view(np.uint32)[word] |= np.uint32(1 << bit)
        if self.allowed is None:
            return mask
        # Where allowed_token_ids leave the grammar no way on, the grammar wins: its output
        # stays well formed, rather than every logit being -inf.
        both = mask & self.allowed
        return both if both.any() else mask

    def banned(self, output_ids: Sequence[int], min_tokens_bans: Sequence[int]) -> tuple[int, ...]:
        banned = list(min_tokens_bans)
        if self.bad_words is not None:
            banned += self.bad_words.banned_after(output_ids)
        return tuple(sorted(set(banned)))

    def accept(self, token_id: int) -> None:
        if self.grammar is None:
            return
        if self.reasoning is None or self.reasoning.accept(token_id):
            self.grammar.accept(token_id)

    @property
    def awaits_answer(self) -> bool:
        """A grammar waits for the model to finish reasoning."""
        return self.reasoning is not None and self.reasoning.state != "answer"

    @property
    def grammar_done(self) -> bool:
        """The grammar is complete (its stop token taken) or cannot go on."""
        return self.grammar is not None and (self.grammar.is_terminated or self.grammar.rejected)


ConstraintFactory = Callable[[], TokenConstraints]  # one call per sequence of a request


def with_reasoning_gate(
    factory: ConstraintFactory, start_id: int, end_id: int, *, opened: bool
) -> ConstraintFactory:
    """`factory`, with each sequence's grammar held back by a ReasoningGate."""

    def make() -> TokenConstraints:
        constraints = factory()
        if constraints.grammar is not None:
            constraints.reasoning = ReasoningGate(start_id, end_id, opened=opened)
        return constraints

    return make


class ConstraintBuilder:
    """Turns a request's allowed_token_ids, bad_words and structured_outputs into the
    TokenConstraints of each of its sequences (they share all but the grammar's position)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # the first compiles may come at once

    def prepare(self, params: SamplingParams) -> ConstraintFactory | None:
        """None when `params` constrain nothing; raises ValueError naming the field."""
        if not params.has_constraints:
            return None
        spec = params.structured_outputs
        allowed = None
        if params.allowed_token_ids is not None:
            outside = [t for t in params.allowed_token_ids if t >= self.vocab_size]
            if outside:
                raise ValueError(
                    f"allowed_token_ids must be in [0, {self.vocab_size}), got {outside[0]}"
                )
            allowed = token_mask(params.allowed_token_ids, self.vocab_size)
        bad_words = None
        if params.bad_words:
            bad_words = BadWords(bad_words_token_ids(params.bad_words, self.tokenizer))
        if spec is None:
            return lambda: TokenConstraints(allowed=allowed, bad_words=bad_words)
        grammars = self._grammar_compiler()
        compiled = grammars.compile(spec)

        def make() -> TokenConstraints:
            return TokenConstraints(
                allowed=allowed, bad_words=bad_words, grammar=grammars.state(compiled)
            )

        # At the start, allowed_token_ids that leave the grammar nothing are the client's
        # mistake (later in the output, the grammar wins: see TokenConstraints.next_mask).
        first = grammars.state(compiled).next_mask()
        if allowed is not None:
            first = first & allowed
        if not first.any():
            among = " among allowed_token_ids" if allowed is not None else ""
            raise InvalidGrammarError(spec.kind, f"it allows no output{among}")
        return make

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    self._grammars = GrammarCompiler(
                        self.tokenizer, self.vocab_size, self.eos_token_ids
                    )
                except ImportError:
                    raise ValueError(
                        "structured_outputs needs the xgrammar package (pip install xgrammar)"
                    ) from None
            return self._grammars
