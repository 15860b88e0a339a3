"""Tool choice as an output constraint, and outputs back to tool calls, without a model."""

from __future__ import annotations

import json

import pytest

from aioinfer.server.serving.tools import ChatTool, NamedToolChoice, ToolMode, tool_constraint

WEATHER = ChatTool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
)
TIME = ChatTool.model_validate({"type": "function", "function": {"name": "get_time"}})


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_a_named_choice_constrains_to_that_function_s_parameters():
    constraint = tool_constraint([WEATHER, TIME], named("get_weather"), True)
    assert constraint is not None
    mode, spec = constraint
    assert mode.named == "get_weather" and mode.finish_reason == "stop"
    assert spec.json == WEATHER.function.parameters
    _, spec = tool_constraint([WEATHER, TIME], named("get_time"), True)  # type: ignore[misc]
    assert spec.json == {"type": "object"}  # no parameters: any object


def test_required_is_an_array_of_calls_one_when_not_parallel():
    mode, spec = tool_constraint([WEATHER, TIME], "required", False)  # type: ignore[misc]
    assert mode.named is None and mode.finish_reason == "tool_calls"
    assert isinstance(spec.json, dict)
    assert spec.json["minItems"] == 1 and spec.json["maxItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in spec.json["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    _, spec = tool_constraint([WEATHER], "required", True)  # type: ignore[misc]
    assert isinstance(spec.json, dict) and "maxItems" not in spec.json


def test_none_and_auto_constrain_nothing_and_unknown_names_are_refused():
    assert tool_constraint([WEATHER], "none", True) is None
    assert tool_constraint([WEATHER], "auto", True) is None  # a tool-call parser reads the text
    with pytest.raises(ValueError, match="not among the tools"):
        tool_constraint([WEATHER], named("get_time"), True)
    with pytest.raises(ValueError, match="only allowed when tools are given"):
        tool_constraint([], "required", True)
    with pytest.raises(ValueError, match="only allowed when tools are given"):
        tool_constraint([], "auto", True)
    with pytest.raises(ValueError, match="distinct names; get_time comes twice"):
        tool_constraint([WEATHER, TIME, TIME], "none", True)
    string = tool("s", {"type": "string"})
    with pytest.raises(ValueError, match="must describe an object"):
        tool_constraint([string], named("s"), True)


def tool(name, parameters):
    return ChatTool.model_validate(
        {"type": "function", "function": {"name": name, "parameters": parameters}}
    )


def test_calls_that_would_nest_too_deeply_are_refused_naming_the_tools():
    """A parameters schema as deep as a body allows, wrapped in the array of calls: past the
    64 levels a schema may nest, a 400 naming tools (not structured_outputs)."""
    from aioinfer.server.serving.tools import ToolsError
    from tests.core.test_sampling_params import nested_schema

    deep = tool("deep", {"type": "object", "properties": {"a": nested_schema(58)}})
    tool_constraint([deep], named("deep"), True)  # on its own it fits
    with pytest.raises(ToolsError, match="the schema of the tools' calls nests more than 64") as e:
        tool_constraint([deep], "required", True)
    assert e.value.param == "tools"


def test_tools_with_too_many_numeric_bounds_are_refused_naming_the_tools():
    """The tools' parameters compile as one schema: their numeric bounds count together."""
    from aioinfer.core.sampling_params import MAX_SCHEMA_BOUNDS
    from aioinfer.server.serving.tools import ToolsError
    from tests.core.test_sampling_params import ranged_schema

    half = MAX_SCHEMA_BOUNDS // 4  # ranges: two bounds each
    a, b = tool("a", ranged_schema(half)), tool("b", ranged_schema(half + 1))
    tool_constraint([a, tool("c", ranged_schema(half))], "required", True)  # at the limit
    with pytest.raises(ToolsError, match=f"{MAX_SCHEMA_BOUNDS + 2} numeric bounds") as e:
        tool_constraint([a, b], "required", True)
    assert e.value.param == "tools"


def test_required_moves_each_tool_s_definitions_to_the_top():
    loc = {"type": "object", "properties": {"city": {"type": "string"}}}
    a = tool(
        "a",
        {"type": "object", "$defs": {"Loc": loc}, "properties": {"at": {"$ref": "#/$defs/Loc"}}},
    )
    b = tool(
        "b",
        {"type": "object", "$defs": {"Loc": loc}, "properties": {"to": {"$ref": "#/$defs/Loc"}}},
    )
    _, spec = tool_constraint([a, b], "required", True)  # type: ignore[misc]
    assert isinstance(spec.json, dict) and spec.json["$defs"] == {"Loc": loc}
    for alt in spec.json["items"]["anyOf"]:
        assert "$defs" not in alt["properties"]["parameters"]
    assert "$defs" in a.function.parameters  # the request's own schema is left as it was
    other = tool("c", {"type": "object", "$defs": {"Loc": {"type": "string"}}})
    with pytest.raises(ValueError, match=r"\$defs/Loc in two different ways"):
        tool_constraint([a, other], "required", True)
    tree = tool("t", {"type": "object", "properties": {"child": {"$ref": "#"}}})
    with pytest.raises(ValueError, match="own root"):
        tool_constraint([tree], "required", True)
    assert tool_constraint([tree], named("t"), True) is not None  # its root is the output's


def test_outputs_become_calls_or_none_when_they_do_not_parse():
    (call,) = ToolMode(named="f").calls('{"a": 1}') or []
    assert (call.name, call.arguments) == ("f", '{"a": 1}')
    # A named call is its text, cut short or not (as it streams).
    (call,) = ToolMode(named="f").calls('{"a": ', finished=False) or []
    assert call.arguments == '{"a": '
    assert ToolMode(named=None).calls('[{"name": "f", "parameters": {}}]', finished=False) is None
    assert ToolMode(named=None).calls('{"a": ' + "[" * 5000) is None  # too deep: not JSON
    calls = ToolMode(named=None).calls(
        '[{"name": "f", "parameters": {"x": "é"}}, {"name": "g", "parameters": {}}]'
    )
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": "é"}), ("g", {})]
    assert len({c.id for c in calls}) == 2
    assert ToolMode(named=None).calls('[{"name": "f"}]') is None


def test_a_schema_without_a_type_still_constrains_to_an_object():
    """{"properties": ...} alone would let an array or a string through as the arguments."""
    untyped = ChatTool.model_validate(
        {"type": "function",
         "function": {"name": "f", "parameters": {"properties": {"x": {"type": "integer"}}}}}
    )  # fmt: skip
    _, spec = tool_constraint([untyped], named("f"), True)  # type: ignore[misc]
    assert spec.json == {"properties": {"x": {"type": "integer"}}, "type": "object"}
    assert untyped.function.parameters == {"properties": {"x": {"type": "integer"}}}  # unchanged
    # Calls whose parameters are not an object are no calls.
    assert ToolMode(named=None).calls('[{"name": "f", "parameters": [1]}]') is None
