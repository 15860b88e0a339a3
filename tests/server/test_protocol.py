"""The pure protocol layer: strict request parsing, readable errors, SamplingParams building,
the OpenAPI document."""

from __future__ import annotations

import pytest

from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.openai.protocol import CompletionRequest
from aioinfer.server.openai.tokenize_protocol import TokenizeRequest
from aioinfer.server.openapi import openapi_document
from aioinfer.server.serving.protocol import ChatCompletionRequest


def completion(**fields):
    return CompletionRequest.parse({"prompt": "hi", **fields})


def chat(**fields):
    return ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "hi"}], **fields})


def refused(factory, **fields) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        factory(**fields)
    return info.value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "10"),
        ("max_tokens", 1.5),
        ("max_tokens", 10.0),
        ("n", True),
        ("temperature", "0.5"),
        ("echo", 1),
        ("stream", "true"),
        ("seed", 3.0),
    ],
)
def test_types_are_strict(field, value):
    error = refused(completion, **{field: value})
    assert error.param == field
    assert field in error.message and repr(value) in error.message


def test_errors_inside_lists_name_the_element():
    error = refused(completion, stop_token_ids=[1, "2"])
    assert error.param == "stop_token_ids[1]"
    assert "valid integer, got '2' (string)" in error.message


def test_integers_are_valid_floats_and_unknown_fields_are_ignored():
    req = completion(temperature=1, top_p=1, frequency_penalty=0, some_future_field={"x": 1})
    params = req.to_sampling_params({})
    assert params.temperature == 1.0 and isinstance(params.temperature, float)


@pytest.mark.parametrize(
    "prompt", ["", "text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]], ids=lambda p: repr(p)
)
def test_prompt_shapes(prompt):
    assert CompletionRequest.parse({"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("prompt", [[], [[]], ["a", 1], [[1, "2"]], [1.0], None, {"a": 1}, [True]])
def test_bad_prompt_shapes_name_the_allowed_ones(prompt):
    error = refused(CompletionRequest.parse, data={"prompt": prompt})
    assert error.param == "prompt"
    assert "a list of token ids" in error.message


def test_missing_fields():
    assert refused(CompletionRequest.parse, data={}).param == "prompt"
    assert refused(ChatCompletionRequest.parse, data={}).param == "messages"
    assert refused(ChatCompletionRequest.parse, data={"messages": []}).param == "messages"


def test_chat_message_errors_point_into_the_list():
    error = refused(chat, messages=[{"role": "user", "content": "a"}, {"role": "function"}])
    assert error.param == "messages[1].role"
    assert "'system', 'developer', 'user', 'assistant' or 'tool'" in error.message
    error = refused(chat, messages=[{"role": "tool", "content": "3 C"}])
    assert error.param == "messages[0].tool_call_id"
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    error = refused(chat, messages=[{"role": "user", "content": [image]}])
    assert error.param == "messages[0].content"
    assert "only text content parts" in error.message


def test_a_message_without_content_is_refused_unless_it_calls_tools():
    """As OpenAI: a user or system message needs content (it once generated from an empty
    turn); an assistant message that only calls tools may leave it out."""
    for role in ("user", "system", "developer", "tool"):
        message = {"role": role, **({"tool_call_id": "c"} if role == "tool" else {})}
        for req in (chat, lambda **f: TokenizeRequest.parse(f)):
            error = refused(req, messages=[{"role": "user", "content": "hi"}, message])
            assert error.param == "messages[1].content", error
            assert f"a {role} message needs content" in error.message
    error = refused(chat, messages=[{"role": "user", "content": None}])
    assert error.param == "messages[0].content"
    error = refused(chat, messages=[{"role": "user", "content": "a"}, {"role": "assistant"}])
    assert error.param == "messages[1].content" and "content or tool_calls" in error.message
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    assert chat(messages=messages).messages[1].content is None
    assert chat(messages=[{"role": "user", "content": ""}]).messages[0].content == ""


def test_text_parts_are_joined():
    req = chat(
        messages=[
            {"role": "system", "content": ""},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert req.template_messages() == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize(
    ("factory", "fields", "param"),
    [
        (completion, {"suffix": "tail"}, "suffix"),
        (completion, {"best_of": 2}, "best_of"),
        (chat, {"guided_json": {"type": "object"}}, "guided_json"),
        (completion, {"guided_choice": ["a", "b"]}, "guided_choice"),
        (chat, {"tool_choice": "auto"}, "tool_choice"),
        (chat, {"functions": [{"name": "f"}]}, "functions"),
        (chat, {"response_format": {"type": "xml"}}, "response_format.type"),
        (completion, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (chat, {"top_logprobs": 2}, "top_logprobs"),
        (chat, {"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_fields_are_refused_by_name(factory, fields, param):
    error = refused(factory, **fields)
    assert error.param == param
    assert param in error.message


def test_legacy_function_calling_points_to_tools():
    for fields in ({"functions": [{"name": "f"}]}, {"function_call": "none"}):
        assert "send tools and tool_choice" in refused(chat, **fields).message


def test_structured_outputs_become_sampling_params():
    json_object = chat(response_format={"type": "json_object"}).to_sampling_params({})
    assert json_object.structured_outputs is not None
    assert json_object.structured_outputs.json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    spec = completion(response_format=fmt).to_sampling_params({}).structured_outputs
    assert spec is not None and spec.json == schema
    spec = chat(structured_outputs={"choice": ["x", "y"]}).to_sampling_params({}).structured_outputs
    assert spec is not None and spec.choice == ["x", "y"] and spec.kind == "choice"
    assert chat(response_format={"type": "text"}).to_sampling_params({}).structured_outputs is None
    with pytest.raises(RequestValidationError) as info:
        chat(response_format={"type": "json_schema"}).to_sampling_params({})
    assert info.value.param == "response_format"
    extras = completion(allowed_token_ids=[1, 2], bad_words=["no"], truncate_prompt_tokens=5)
    params = extras.to_sampling_params({})
    assert (params.allowed_token_ids, params.bad_words, params.truncate_prompt_tokens) == (
        [1, 2],
        ["no"],
        5,
    )


def test_no_op_values_of_unsupported_fields_pass():
    chat(tools=[], tool_choice="none", response_format={"type": "text"})
    completion(suffix="", best_of=1)


def test_sampling_params_defaults_order():
    defaults = {"temperature": 0.3, "top_k": 7, "repetition_penalty": 1.1}
    params = completion(top_k=3).to_sampling_params(defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.3, 3, 1.1)
    assert params.max_tokens == 16 and params.top_p == 1.0
    assert chat().to_sampling_params({}).max_tokens is None
    assert chat(max_tokens=5).to_sampling_params({}).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).to_sampling_params({}).max_tokens == 7


def test_sampling_fields_map_to_sampling_params():
    params = completion(
        n=2,
        stop=["x", "yz"],
        stop_token_ids=[5],
        seed=3,
        logit_bias={"12": -100, "7": 2.5},
        logprobs=2,
        echo=True,
        ignore_eos=True,
        min_tokens=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    ).to_sampling_params({})
    assert params.n == 2 and params.stop_strings == ["x", "yz"] and params.stop_token_ids == [5]
    assert params.logit_bias == {12: -100.0, 7: 2.5}
    assert params.logprobs == 2 and params.prompt_logprobs == 2
    assert params.ignore_eos and params.min_tokens == 2 and params.include_stop_str_in_output
    assert not params.skip_special_tokens
    assert chat(logprobs=True).to_sampling_params({}).logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).to_sampling_params({}).logprobs == 3
    assert chat(logprobs=False).to_sampling_params({}).logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        # keys int() reads but that are not token ids written out: "5_0" would be 50
        ({"logit_bias": {" 5": 1}}, "logit_bias"),
        ({"logit_bias": {"5_0": 1}}, "logit_bias"),
        ({"logit_bias": {"٣": 1}}, "logit_bias"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_sampling_param_errors_name_the_field(fields, param):
    with pytest.raises(RequestValidationError) as info:
        completion(**fields).to_sampling_params({})
    assert info.value.param == param
    assert param in info.value.message


def test_max_completion_tokens_errors_name_it():
    """It once reported as max_tokens, a field the request did not send."""
    with pytest.raises(RequestValidationError) as info:
        chat(max_completion_tokens=0).to_sampling_params({})
    assert info.value.param == "max_completion_tokens"
    assert "max_completion_tokens must be >= 1" in info.value.message


@pytest.mark.parametrize(
    ("make", "field"),
    [(completion, "logprobs"), (completion, "prompt_logprobs"), (chat, "prompt_logprobs")],
)
def test_the_whole_vocabulary_of_logprobs_is_offline_only(make, field):
    """The offline API's -1 is not the HTTP API's (its renderers trim to a width)."""
    with pytest.raises(RequestValidationError) as info:
        make(**{field: -1})
    assert info.value.param == field


@pytest.mark.parametrize("make", [completion, chat])
def test_temperature_is_at_most_2_as_openai_s(make):
    """OpenAI's range (and vLLM 0.33's); the offline SamplingParams takes any temperature."""
    with pytest.raises(RequestValidationError) as info:
        make(temperature=2.5)
    assert info.value.param == "temperature" and "less than or equal to 2" in info.value.message
    assert make(temperature=2.0).temperature == 2.0


def test_tokenize_request_takes_one_input():
    assert TokenizeRequest.parse({"prompt": "x"}).prompt == "x"
    with pytest.raises(RequestValidationError):
        TokenizeRequest.parse({})
    with pytest.raises(RequestValidationError):
        TokenizeRequest.parse({"prompt": "x", "messages": [{"role": "user", "content": "y"}]})


def test_openapi_document_refs_resolve():
    doc = openapi_document("1.2.3")
    schemas = doc["components"]["schemas"]
    refs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/")
        assert ref.rsplit("/", 1)[1] in schemas, ref
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert {"/v1/models", "/v1/completions", "/tokenize", "/health"} <= set(doc["paths"])


def test_a_bad_text_part_is_reported_where_the_client_wrote_it():
    """Not also as "content.str: Input should be a valid string" (the union's other
    alternative, which a list is not), nor with pydantic's "list[TextPart]" in the path."""
    for part, why in (({"type": "text"}, "field required"), ({"type": "text", "text": 5}, "5")):
        with pytest.raises(RequestValidationError) as info:
            ChatCompletionRequest.parse({"messages": [{"role": "user", "content": [part]}]})
        assert info.value.param == "messages[0].content[0].text"
        assert (
            info.value.message.startswith("Invalid request: messages[0].content[0].text: ")
            and why in info.value.message
        )
        assert ";" not in info.value.message  # one error, not one per alternative


def test_a_bad_value_of_a_union_is_named_where_the_client_wrote_it():
    """pydantic names a union's alternative in an error's path (literal['none','auto',
    'required'], dict[str,any], NamedToolChoice), and a value that a literal alternative
    does not even take was reported there first: the param named no field a client wrote."""
    from aioinfer.server.openai.protocol import CompletionRequest

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for kind, body, param in (
        (ChatCompletionRequest, {**chat, "tool_choice": "sometimes"}, "tool_choice"),
        (
            ChatCompletionRequest,
            {**chat, "tool_choice": {"type": "function"}},
            "tool_choice.function",
        ),
        (
            CompletionRequest,
            {"prompt": "x", "structured_outputs": {"json": 5}},
            "structured_outputs.json",
        ),
    ):
        with pytest.raises(RequestValidationError) as info:
            kind.parse(body)
        assert info.value.param == param
        assert info.value.message.startswith(f"Invalid request: {param}: ")
        for alternative in ("literal[", "dict[", "NamedToolChoice:", "NamedToolChoice."):
            assert alternative not in info.value.message


def test_many_bad_text_parts_are_described():
    """20,000 bad parts make 20,000 errors, each a text part's, none the string alternative's.
    (The first version of the alternatives filter compared every error with every other: 11 s
    here, hours for the parts a 16 MiB body holds; it now takes one pass, 0.07 s.)"""
    parts = [{"type": "text"}] * 20_000
    with pytest.raises(RequestValidationError) as info:
        ChatCompletionRequest.parse({"messages": [{"role": "user", "content": parts}]})
    assert info.value.param == "messages[0].content[0].text"
    assert "and 19997 more errors" in info.value.message
    assert "content.str" not in info.value.message and "content:" not in info.value.message
