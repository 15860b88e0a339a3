"""SamplingParams: vLLM's field names and meanings, validated on construction."""

from __future__ import annotations

import enum
import json as stdlib_json
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

from aioinfer.config import check_sampling_range

# Below this temperature sampling is greedy (vLLM's threshold).
_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 32
MAX_BAD_WORDS = 128
FLOAT32_MAX = 3.4028234663852886e38
# The most text a structured-outputs spec may hold (its JSON for a schema or the choices), and
# the most choices: see StructuredOutputsParams._check_size.
MAX_SPEC_CHARS = 65536
MAX_CHOICES = 1024
# The deepest a JSON schema may nest (arrays and objects), however it is sent: a request body
# stops there too, while a schema sent as JSON text would not, and the grammar compiler's work
# grows about as depth^3 (400 levels: 4 s; 900: 46 s).
MAX_SCHEMA_DEPTH = 64
# A schema's numeric bounds (minimum, maximum and the exclusive ones, on numbers and integers):
# the grammar compiler writes each as a grammar of its own that spells out the range digit by
# digit, so one costs about 0.5 ms plus 0.06-0.15 ms a digit of its integer part (a minimum of
# 1e308: 33-47 ms), and more as they add up: 64 KiB of 16-digit ranges took 7 s to compile on
# one grammar thread, 64 KiB of minimums of 1e308 87 s. They are bounded in count and in
# digits (a bound counts those of its integer part, at least 1); at these limits a schema of
# nothing but bounds compiles in at most about 0.4 s.
MAX_SCHEMA_BOUNDS = 512
MAX_SCHEMA_BOUND_DIGITS = 2048
_BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# A schema's objects. Their optional properties (not in `required`) may come in any subset,
# and the grammar compiler spells out which may follow each: one object of 2734 of them (64
# KiB) took 236 s to compile, 193 objects of 32 about 5-10 s, on the bundled model's
# vocabulary on a busy 2-core machine. An object that names properties and allows others
# (additionalProperties or unevaluatedProperties not false) excludes the named keys from the
# others' (about 25 ms plus 13 a named property: 64 KiB of such objects of one property would
# take about 25 s), and minProperties or maxProperties count the optional ones (about 10 ms
# plus their number cubed over 500: 128 took 4.5 s). Optional properties are bounded in one
# object and in all; open and counted objects by their weight, about the milliseconds above.
# Required properties, objects of additional properties alone, patternProperties and
# propertyNames cost little. The compile's time also grows faster than the grammar's size, so
# these bound each costly shape, not a whole schema's time (see docs/reliability.md).
MAX_OBJECT_OPTIONAL_PROPERTIES = 128
MAX_SCHEMA_OPTIONAL_PROPERTIES = 1024
MAX_SCHEMA_OBJECT_WEIGHT = 1000
_OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties")
_NUMERIC_TYPES = ("number", "integer")


def nesting_depth(value: object, limit: int) -> int:
    """How deeply lists and dicts nest in `value` (a scalar: 0), without recursion; the scan
    stops once past `limit` (then some number above it)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(
        value
    )


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language; exactly one field is set (vLLM's names).

    json: a JSON schema (a dict or its JSON text); json_object: any JSON object; regex: a
    regular expression; choice: one of these strings; grammar: an EBNF grammar (GBNF style,
    with a `root` rule)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's switches that ask for what holds here anyway: JSON never has free whitespace (a
    # model cannot loop on it), a schema's objects take only the properties it names (the
    # grammar compiler's strict mode), and there is one backend, so no fallback.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    # vLLM's other whitespace for JSON: refused, as JSON here has none.
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"structured_outputs.{name} must be a boolean, got {getattr(self, name)!r}"
                )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported: JSON here never has "
                "free whitespace"
            )
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, list)
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when set")
        self._check_size()

    def _check_size(self) -> None:
        """A grammar's compile time grows faster than its text (200k characters of regex: 9 s
        on two cores), so specs are bounded, as OpenAI bounds its schemas; a schema's nesting
        too (first, as the size of a deep dict is measured by writing it)."""
        if self.json is not None:
            _check_schema(self.json)
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(
                f"structured_outputs.choice must hold at most {MAX_CHOICES} strings, got "
                f"{len(self.choice)}"
            )
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            size = len(value) if isinstance(value, str) else len(stdlib_json.dumps(value))
            if size > MAX_SPEC_CHARS:
                raise ValueError(
                    f"structured_outputs.{name} must be at most {MAX_SPEC_CHARS} characters "
                    f"long, got {size}"
                )

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)


def _check_schema(schema: str | dict[str, Any]) -> None:
    """A schema's nesting, then its numeric bounds (see MAX_SCHEMA_BOUNDS)."""
    too_deep = f"structured_outputs.json nests more than {MAX_SCHEMA_DEPTH} levels deep"
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            return  # refused for its size, without parsing it
        try:
            schema = stdlib_json.loads(schema)
        except RecursionError:  # thousands of levels
            raise ValueError(too_deep) from None
        except ValueError:
            return  # not JSON: the compiler says so
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(too_deep)
    bounds, digits = numeric_bounds(schema)
    if bounds > MAX_SCHEMA_BOUNDS:
        raise ValueError(
            f"structured_outputs.json has {bounds} numeric bounds (minimum, maximum, "
            f"exclusiveMinimum, exclusiveMaximum); at most {MAX_SCHEMA_BOUNDS} are allowed, as "
            "each compiles to a grammar of its own"
        )
    if digits > MAX_SCHEMA_BOUND_DIGITS:
        raise ValueError(
            f"structured_outputs.json's numeric bounds have {digits} digits in all (a bound "
            f"counts those of its integer part: 1e300 counts 301); at most "
            f"{MAX_SCHEMA_BOUND_DIGITS} are allowed"
        )
    optional, widest, weight = object_costs(schema)
    if widest > MAX_OBJECT_OPTIONAL_PROPERTIES or optional > MAX_SCHEMA_OPTIONAL_PROPERTIES:
        raise ValueError(
            f"structured_outputs.json has {optional} optional properties (not in their "
            f"object's required), {widest} in one object; at most "
            f"{MAX_OBJECT_OPTIONAL_PROPERTIES} are allowed in one object and "
            f"{MAX_SCHEMA_OPTIONAL_PROPERTIES} in all, as the grammar spells out which may "
            "follow each: require them, or split the schema"
        )
    if weight > MAX_SCHEMA_OBJECT_WEIGHT:
        raise ValueError(
            f"structured_outputs.json's open and counted objects weigh {weight:.0f}; at most "
            f"{MAX_SCHEMA_OBJECT_WEIGHT} is allowed (about milliseconds of compiling): an object "
            "that names properties and allows others (additionalProperties or "
            "unevaluatedProperties) weighs 25 plus 13 a named property, one with minProperties "
            "or maxProperties 10 plus its optional properties cubed over 500"
        )


def numeric_bounds(schema: object) -> tuple[int, int]:
    """The numeric bounds in a (parsed) schema, wherever they sit, and their digits: a bound
    counts once for each numeric type its schema lists (each is compiled), and its digits are
    those of its integer part (at least 1). Without recursion; the nesting is checked first."""
    bounds = digits = 0
    for node in _objects(schema):
        kinds = node.get("type")
        times = 1
        if isinstance(kinds, list):
            times = max(1, sum(1 for kind in kinds if kind in _NUMERIC_TYPES))
        for key in _BOUND_KEYWORDS:
            value = node.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, int) or math.isfinite(value):
                bounds += times
                digits += times * _integer_digits(value)
    return bounds, digits


def object_costs(schema: object) -> tuple[int, int, float]:
    """A (parsed) schema's optional properties in all, the most in one object, and the weight
    of its open and counted objects (see MAX_SCHEMA_OBJECT_WEIGHT). Without recursion; the
    nesting is checked first."""
    optional_in_all = widest = 0
    weight = 0.0
    for node in _objects(schema):
        properties = node.get("properties")
        if not isinstance(properties, dict) or not properties:
            continue
        required = node.get("required")
        listed = set()
        if isinstance(required, list):
            listed = {name for name in required if isinstance(name, str)}
        optional = len(properties) - len(listed & set(properties))
        optional_in_all += optional
        widest = max(widest, optional)
        if optional and ("minProperties" in node or "maxProperties" in node):
            weight += 10 + optional**3 / 500
        if any(node.get(key, False) is not False for key in _OPEN_KEYWORDS):
            weight += 25 + 13 * len(properties)
    return optional_in_all, widest, weight


def _objects(schema: object) -> Iterator[dict[str, Any]]:
    """Every JSON object in a (parsed) schema, at any depth, without recursion."""
    stack: list[object] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
            yield node
        elif isinstance(node, list):
            stack.extend(node)


def _integer_digits(value: float) -> int:
    """The digits of a finite number's integer part, at least 1 (1e300: 301)."""
    size = abs(value)
    if isinstance(size, int) and size < _WRITABLE_INT:
        return len(str(size))
    return 1 if size < 1 else math.floor(math.log10(size)) + 1


_WRITABLE_INT = 10**4000  # str() refuses ints of more than 4300 digits


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
GuidedDecodingParams = StructuredOutputsParams  # vLLM 0.10's name


class SamplingType(enum.IntEnum):
    """vLLM's: how a request's tokens are drawn (`SamplingParams.sampling_type`)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each output of a request in flight holds. The offline LLM returns only
    final outputs, whatever a request asks, as vLLM's LLM does."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's output. Every check raises ValueError naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's max length
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs of each sampled token (-1: the vocabulary)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's field for slow tokenizers; fast ones (the only kind here, as in vLLM's fast
    # detokenizer) write special tokens as they decode, whatever it says.
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # words (one or more tokens) never generated
    structured_outputs: StructuredOutputsParams | None = None
    # Keep only the last k prompt tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    # vLLM's field for custom sampling code: carried along, read by nothing here.
    extra_args: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM 0.10's name for structured_outputs (and GuidedDecodingParams for its class).
    guided_decoding: StructuredOutputsParams | None = None
    # vLLM's: True computes every prompt token rather than taking a cached prefix (None: only
    # for prompt logprobs, which need every token computed).
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(value := getattr(self, name), (tuple, set, frozenset)):
                setattr(self, name, list(value))  # vLLM takes any collection
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(flag := getattr(self, name), bool):  # vLLM reads True as 1
                setattr(self, name, 1 if flag else None)
        if self.output_kind in tuple(RequestOutputKind) and not isinstance(self.output_kind, bool):
            self.output_kind = RequestOutputKind(self.output_kind)
        else:
            raise ValueError(
                "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got "
                f"{self.output_kind!r}"
            )
        if self.guided_decoding is not None:
            if self.structured_outputs not in (None, self.guided_decoding):
                raise ValueError(
                    "set structured_outputs or guided_decoding (its old name), not both"
                )
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self._check_types()
        self._check_ranges()
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        # As vLLM's: scripts append to these lists.
        self.stop = self.stop_strings
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if self.is_greedy:
            # Greedy ignores the truncation knobs; normalise them so the sampler can skip work.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def __setattr__(self, name: str, value: Any) -> None:
        # As vLLM's (a msgspec struct): a misspelt or unknown field set on the object fails,
        # where a dataclass would take it and every request would ignore it.
        if name not in _SAMPLING_FIELDS:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        object.__setattr__(self, name, value)

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list; read when a request starts, so a `stop` set after
        construction (as vLLM scripts do) counts."""
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop or [])

    @property
    def has_constraints(self) -> bool:
        """Whether anything beyond the stop rules limits the sampled tokens (see
        core/constraints.py)."""
        return (
            self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.structured_outputs is not None
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @classmethod
    def from_optional(cls, **fields: Any) -> SamplingParams:
        """vLLM's constructor for request bodies where an absent field arrives as None: None
        takes the field's default, and logit_bias's token ids may be strings (JSON keys)."""
        defaults = {
            "n": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
        }
        for name, default in defaults.items():
            if fields.get(name) is None:
                fields[name] = default
        bias = fields.get("logit_bias")
        if isinstance(bias, dict):
            try:
                fields["logit_bias"] = {int(token): value for token, value in bias.items()}
            except (TypeError, ValueError):
                raise ValueError(
                    f"logit_bias must map integer token ids to numbers, got {bias!r}"
                ) from None
        return cls(**fields)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)

    def checked_copy(self) -> SamplingParams:
        """A copy with its own lists, checked again: what a request keeps, so that fields a
        script sets after construction (as vLLM scripts do) are checked before the request is
        queued, and later changes to this object do not reach it."""
        lists = ("stop", "stop_token_ids", "allowed_token_ids", "bad_words")
        copies: dict[str, Any] = {
            n: list(v) for n in lists if isinstance(v := getattr(self, n), list)
        }
        if isinstance(self.logit_bias, dict):
            copies["logit_bias"] = dict(self.logit_bias)
        return replace(self, **copies)

    def for_sequence(self, index: int) -> SamplingParams:
        """Sequence `index`'s params (of n): a seeded request's sequences draw from seeds seed,
        seed + 1, ..., wrapped into the 64-bit range a seed may take."""
        if self.n == 1 or self.seed is None:
            return self
        seed = self.seed + index
        if seed >= 2**64:
            seed -= 2**64
        return self.clone(seed=seed)

    def _check_types(self) -> None:
        ints = ("n", "top_k", "min_tokens")
        optional_ints = (
            "seed",
            "max_tokens",
            "logprobs",
            "prompt_logprobs",
            "truncate_prompt_tokens",
        )
        numbers = (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        bools = (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        )
        skip = self.skip_reading_prefix_cache
        if not (skip is None or isinstance(skip, bool)):
            raise ValueError(
                "skip_reading_prefix_cache must be a boolean or null, got "
                f"{self.skip_reading_prefix_cache!r}"
            )
        for name in ints:
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in optional_ints:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer or null, got {value!r}")
        for name in numbers:
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in bools:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not (
            self.stop is None
            or isinstance(self.stop, str)
            or (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop))
        ):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, list) and all(_is_int(t) for t in self.stop_token_ids)
        ):
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        if self.allowed_token_ids is not None and not (
            isinstance(self.allowed_token_ids, list)
            and all(_is_int(t) for t in self.allowed_token_ids)
        ):
            raise ValueError(
                f"allowed_token_ids must be a list of integers, got {self.allowed_token_ids!r}"
            )
        if self.bad_words is not None and not (
            isinstance(self.bad_words, list) and all(isinstance(w, str) for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{self.structured_outputs!r}"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}"
                )
            for token, bias in self.logit_bias.items():
                # -inf bans the token; any finite bias is added as given, as in vLLM.
                if not _is_int(token) or not (_is_number(bias) or bias == -math.inf):
                    raise ValueError(
                        f"logit_bias must map integer token ids to numbers, got {token!r}: {bias!r}"
                    )

    def _check_ranges(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if self.n < 1:
            raise bad("n", ">= 1")
        for name in ("temperature", "top_p", "top_k", "min_p"):
            check_sampling_range(name, getattr(self, name))
        if self.max_tokens is not None:
            check_sampling_range("max_tokens", self.max_tokens)
        if self.min_tokens < 0:
            raise bad("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            check_sampling_range(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise bad(name, ">= 0, or -1 for the whole vocabulary")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "a 64-bit integer")
        stops = self.stop_strings
        if any(s == "" for s in stops):
            raise ValueError("stop must not contain empty strings")
        if stops and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: they are matched in the text")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "non-negative token ids")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "non-negative token ids")
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(
                    f"bad_words must hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}"
                )
            if any(not w.strip() for w in self.bad_words):
                raise ValueError("bad_words must not contain empty words")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise bad("truncate_prompt_tokens", "-1 (the context length) or >= 1")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if math.isfinite(bias) and abs(bias) > FLOAT32_MAX:
                # the logits are float32: a bias beyond it would be an infinity there
                raise ValueError(
                    f"logit_bias values must be within +-{FLOAT32_MAX:.4g} (float32), or -inf, "
                    f"got {bias!r} for token {token}"
                )


_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
