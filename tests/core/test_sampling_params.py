from __future__ import annotations

import math

import pytest

from aioinfer.core.sampling_params import MAX_STOP_STRINGS, SamplingParams, SamplingType


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
        16,
    )
    assert p.stop_strings == [] and p.stop_token_ids == [] and not p.is_greedy


def test_greedy_normalises_truncation():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_stop_string_becomes_a_list_and_top_k_minus_one_disables():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop_strings == ["###"] and p.top_k == 0


def test_seed_minus_one_means_no_seed_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("n", 0, ">= 1"),
        ("temperature", -0.1, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "-1, 0"),
        ("min_p", 1.1, "[0, 1]"),
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("logprobs", -2, ">= 0, or -1"),
        ("prompt_logprobs", -5, ">= 0, or -1"),
        ("temperature", float("nan"), "finite"),
        ("max_tokens", 1.5, "integer"),
        ("n", True, "integer"),
        ("top_p", "0.5", "number"),
        ("ignore_eos", 1, "boolean"),
        ("spaces_between_special_tokens", 0, "boolean"),
        ("stop", [1, 2], "list of strings"),
        ("stop", [""], "empty"),
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1), "at most"),
        ("stop_token_ids", [-1], "non-negative"),
        ("logit_bias", {5: math.inf}, "numbers"),
        ("logit_bias", {5: math.nan}, "numbers"),
        ("logit_bias", {"5": 1.0}, "integer token ids"),
        ("logit_bias", {5: 1e39}, "float32"),  # an infinity among float32 logits
        ("logit_bias", {5: -1e39}, "float32"),
        ("skip_reading_prefix_cache", 1, "boolean or null"),
    ],
)
def test_invalid_values_name_the_field(field, value, fragment):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert field.split("_")[0] in message and fragment in message


def test_vllm_s_looser_types():
    """Collections other than lists, and biases beyond OpenAI's [-100, 100] (offline only;
    -inf bans the token), as vLLM's SamplingParams takes them."""
    bias = {5: -1e9, 6: -math.inf, 7: 250.0}
    params = SamplingParams(stop=("a", "b"), stop_token_ids=(2, 3), allowed_token_ids=(4,),
                            bad_words=("x",), logit_bias=bias)  # fmt: skip
    assert (params.stop, params.stop_token_ids) == (["a", "b"], [2, 3])
    assert (params.allowed_token_ids, params.bad_words) == ([4], ["x"])
    assert params.logit_bias == bias


def test_logprobs_as_vllm_reads_them():
    """-1 asks for the whole vocabulary (the engine resolves it); True is vLLM's 1."""
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    flags = SamplingParams(logprobs=True, prompt_logprobs=False)
    assert (flags.logprobs, flags.prompt_logprobs) == (1, None)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=100)


def test_has_penalties_and_clone():
    assert not SamplingParams().has_penalties
    p = SamplingParams(repetition_penalty=1.2)
    assert p.has_penalties
    q = p.clone(seed=3)
    assert q.seed == 3 and q.repetition_penalty == 1.2 and p.seed is None


def test_checked_copy_checks_again_and_owns_its_collections():
    """What a request keeps: later changes to the caller's object do not reach it, and fields
    set after construction are checked as on construction."""
    params = SamplingParams(stop=["a"], stop_token_ids=[3], bad_words=["x"], logit_bias={1: 2.0})
    copy = params.checked_copy()
    params.stop.append("b")
    params.stop_token_ids.append(4)
    params.bad_words.append("y")
    params.logit_bias[2] = 1.0
    assert (copy.stop, copy.stop_token_ids, copy.bad_words) == (["a"], [3], ["x"])
    assert copy.logit_bias == {1: 2.0}
    params.top_k = -1  # normalised as on construction
    assert params.checked_copy().top_k == 0
    params.top_k = 2.5
    with pytest.raises(ValueError, match="top_k must be an integer"):
        params.checked_copy()


def test_structured_output_specs_are_bounded():
    """A spec's compile time grows faster than its text: specs stop at MAX_SPEC_CHARS
    characters (a schema's JSON, the choices') and MAX_CHOICES choices."""
    from aioinfer.core.sampling_params import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputsParams

    StructuredOutputsParams(regex="a" * MAX_SPEC_CHARS)
    StructuredOutputsParams(choice=["a"] * MAX_CHOICES)
    for spec, fragment in (
        ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "regex must be at most"),
        ({"grammar": "x" * (MAX_SPEC_CHARS + 1)}, "grammar must be at most"),
        ({"json": {"enum": ["e" * 100] * 700}}, "json must be at most"),
        ({"choice": ["c" * 1000] * 70}, "choice must be at most"),
        ({"choice": ["c"] * (MAX_CHOICES + 1)}, f"at most {MAX_CHOICES} strings"),
    ):
        with pytest.raises(ValueError, match=fragment):
            StructuredOutputsParams(**spec)


def nested_schema(depth: int) -> dict:
    """`depth` arrays of arrays around a string: xgrammar's work grows about as depth**3."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nests_at_most_64_levels_however_it_is_sent():
    """The body's own 64-level limit does not see inside a schema sent as JSON text, which
    once took 46 s to compile at depth 900, and raised RecursionError (a 500) at 3000."""
    import json
    import time

    from aioinfer.core.sampling_params import (
        MAX_SCHEMA_DEPTH,
        StructuredOutputsParams,
        nesting_depth,
    )

    assert nesting_depth(nested_schema(10), 100) == 11  # the string schema is a level too
    assert nesting_depth([[{"a": [1]}]], 100) == 4 and nesting_depth("text", 5) == 0
    assert nesting_depth(nested_schema(1000), 64) == 65  # stops once past the limit
    StructuredOutputsParams(json=nested_schema(MAX_SCHEMA_DEPTH - 1))
    StructuredOutputsParams(json=json.dumps(nested_schema(MAX_SCHEMA_DEPTH - 1)))
    for spec in (
        json.dumps(nested_schema(400)),
        nested_schema(MAX_SCHEMA_DEPTH),
        "[" * 3000 + "]" * 3000,  # past the JSON parser's recursion limit
        "[" * 60_000,  # and not even JSON
    ):
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"structured_outputs\.json nests more than 64"):
            StructuredOutputsParams(json=spec)
        assert time.monotonic() - start < 0.5
    # Text that is not JSON is left to the compiler, which names what is wrong.
    StructuredOutputsParams(json="{not json")


def ranged_schema(ranges: int, low: float = -1234, high: float = 5678) -> dict:
    """An object of `ranges` number properties, each with a minimum and a maximum."""
    properties = {
        f"p{i}": {"type": "number", "minimum": low - i, "maximum": high + i} for i in range(ranges)
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def test_a_schema_s_numeric_bounds_are_bounded_in_count_and_digits():
    """The compiler spells each numeric bound out digit by digit: 64 KiB of 16-digit ranges
    took 7 s to compile, 64 KiB of minimums of 1e308 87 s. A schema holds at most
    MAX_SCHEMA_BOUNDS bounds with MAX_SCHEMA_BOUND_DIGITS digits in their integer parts, however
    it is sent, refused before anything compiles."""
    import json
    import time

    from aioinfer.core.sampling_params import (
        MAX_SCHEMA_BOUND_DIGITS,
        MAX_SCHEMA_BOUNDS,
        StructuredOutputsParams,
        numeric_bounds,
    )

    assert numeric_bounds(ranged_schema(3)) == (6, 24)  # 4 digits a bound
    listed = {"type": ["number", "integer", "null"], "minimum": 0.5, "maximum": 1e300}
    assert numeric_bounds(listed) == (4, 2 + 2 * 301)  # once for each numeric type
    named = {"properties": {"minimum": {"type": "string"}}, "maximum": True}
    assert numeric_bounds(named) == (0, 0)  # a property's name, a boolean: no bounds
    assert numeric_bounds(json.loads('{"minimum": 1' + "0" * 500 + "}")) == (1, 501)
    assert numeric_bounds(json.loads('{"minimum": 1e400, "maximum": NaN}')) == (0, 0)
    at_limit = ranged_schema(MAX_SCHEMA_BOUNDS // 2)
    StructuredOutputsParams(json=at_limit)
    StructuredOutputsParams(json=json.dumps(at_limit))
    huge = {"type": "number", "minimum": 1e308}  # 309 digits
    few_but_long = {"type": "array", "prefixItems": [huge] * (MAX_SCHEMA_BOUND_DIGITS // 309)}
    StructuredOutputsParams(json=few_but_long)
    for spec, fragment in (
        (ranged_schema(MAX_SCHEMA_BOUNDS // 2 + 1), f"{MAX_SCHEMA_BOUNDS + 2} numeric bounds"),
        (json.dumps(ranged_schema(700)), "1400 numeric bounds"),
        ({**few_but_long, "prefixItems": [huge] * 7}, f"{7 * 309} digits in all"),
        (json.dumps(ranged_schema(200, low=-1e15, high=1e15)), "6400 digits in all"),
    ):
        start = time.monotonic()
        with pytest.raises(ValueError, match=rf"structured_outputs\.json.*{fragment}"):
            StructuredOutputsParams(json=spec)
        assert time.monotonic() - start < 0.5


def an_object(count: int, required: bool = False, **keywords: object) -> dict:
    """An object of `count` properties of any value, optional unless `required`."""
    properties = {f"p{i}": {} for i in range(count)}
    schema: dict = {"type": "object", "properties": properties, **keywords}
    if required:
        schema["required"] = list(properties)
    return schema


def test_a_schema_s_costly_objects_are_bounded():
    """The compiler spells out which optional properties may follow each one, excludes an
    open object's named keys from its others' and counts optional properties for
    minProperties and maxProperties: one object of 2734 optional properties (64 KiB) took 236 s
    to compile, 64 KiB of open objects about 25 s. Optional properties are bounded in one
    object and in all, open and counted objects by their weight, however the schema is sent."""
    import json
    import time

    from aioinfer.core.sampling_params import (
        MAX_OBJECT_OPTIONAL_PROPERTIES,
        MAX_SCHEMA_OBJECT_WEIGHT,
        MAX_SCHEMA_OPTIONAL_PROPERTIES,
        StructuredOutputsParams,
        object_costs,
    )

    assert object_costs(an_object(3000, required=True)) == (0, 0, 0)  # required: cheap
    counted_map = {"type": "object", "additionalProperties": {}, "minProperties": 9}
    assert object_costs(counted_map) == (0, 0, 0)  # no named properties
    assert object_costs({"anyOf": [an_object(30), an_object(20)]}) == (50, 30, 0)
    assert object_costs(an_object(10, minProperties=1)) == (10, 10, 10 + 10**3 / 500)
    assert object_costs(an_object(1, required=True, additionalProperties=True)) == (0, 0, 38)
    closed = an_object(1, required=True, additionalProperties=False)
    assert object_costs({"anyOf": [closed, {**closed, "required": [{}]}]}) == (1, 1, 0)
    widest, in_all = MAX_OBJECT_OPTIONAL_PROPERTIES, MAX_SCHEMA_OPTIONAL_PROPERTIES
    assert MAX_SCHEMA_OBJECT_WEIGHT == 1000  # the weights below are at this limit
    for at_limit, past, fragment in (
        (an_object(widest), an_object(widest + 1), f"{widest + 1} in one object"),
        (
            {"prefixItems": [an_object(widest)] * (in_all // widest)},
            {"prefixItems": [an_object(widest)] * (in_all // widest + 1)},
            f"{in_all + widest} optional properties",
        ),
        (an_object(79, minProperties=1), an_object(80, maxProperties=80), "weigh 1034"),
        (
            {"prefixItems": [an_object(1, True, unevaluatedProperties={})] * 26},
            {"prefixItems": [an_object(1, True, additionalProperties={})] * 27},
            "weigh 1026",
        ),
    ):
        StructuredOutputsParams(json=at_limit)
        StructuredOutputsParams(json=json.dumps(at_limit))
        with pytest.raises(ValueError, match=rf"structured_outputs\.json.*{fragment}"):
            StructuredOutputsParams(json=past)
    start = time.monotonic()
    with pytest.raises(ValueError, match="2700 optional properties"):
        StructuredOutputsParams(json=json.dumps(an_object(2700)))  # 2734 strings: 236 s
    assert time.monotonic() - start < 0.5


def test_an_unknown_field_set_afterwards_fails_as_in_vllm():
    params = SamplingParams()
    params.max_tokens = 5  # a field: taken, and checked when the request queues
    assert params.checked_copy().max_tokens == 5
    with pytest.raises(AttributeError, match="SamplingParams has no field 'max_token'"):
        params.max_token = 5  # type: ignore[attr-defined]
    assert not hasattr(params, "max_token")


def test_from_optional_fills_nones_with_defaults_as_vllm():
    """vLLM's SamplingParams.from_optional: a request body's absent fields arrive as None and
    take the defaults; max_tokens None stays None (up to the context); JSON's string token ids
    in logit_bias become integers."""
    params = SamplingParams.from_optional(
        n=None,
        temperature=None,
        top_p=None,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        max_tokens=None,
        seed=7,
        logit_bias={"5": 2.0},
    )
    defaults = SamplingParams()
    for name in ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty"):
        assert getattr(params, name) == getattr(defaults, name), name
    assert params.repetition_penalty == 1.0
    assert params.max_tokens is None and params.seed == 7 and params.logit_bias == {5: 2.0}
    assert SamplingParams.from_optional(temperature=0.5, n=2).temperature == 0.5
    with pytest.raises(ValueError, match="logit_bias must map integer token ids"):
        SamplingParams.from_optional(logit_bias={"five": 1.0})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_optional(top_p=0.0)  # given values are checked as usual
    with pytest.raises(TypeError):
        SamplingParams.from_optional(no_such_field=None)


def test_sampling_type_as_vllm():
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.8).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=3).sampling_type is SamplingType.RANDOM_SEED
