"""How chat messages become the prompt: the model's template as Hugging Face renders it, with
add_generation_prompt, continue_final_message, text parts and the developer role, for
/v1/chat/completions and /tokenize alike."""

from __future__ import annotations

import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from tests.server.conftest import chat_prompt_ids, expected_output
from tests.server.test_http import error_of, post
from tests.support.tokenizers import make_tokenizer

CONTINUED = [
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "The colour is"},
]


async def test_chat_without_generation_prompt_and_with_text_parts(client):
    parts = [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world"}]
    body = {
        "messages": [{"role": "user", "content": parts}],
        "add_generation_prompt": False,
        "max_completion_tokens": 3,
    }
    _, raw = await post(client, "/v1/chat/completions", body)
    ids = chat_prompt_ids([{"role": "user", "content": "Hello,\nworld"}], False)
    assert orjson.loads(raw)["choices"][0]["message"]["content"] == expected_output(ids, 3)[1]


async def test_continue_final_message_leaves_the_last_message_open(client):
    ids = chat_prompt_ids(CONTINUED, False, continue_final_message=True)
    assert ids != chat_prompt_ids(CONTINUED, False)  # the template's end of turn is gone
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    _, raw = await post(client, "/tokenize", {"messages": CONTINUED, **flags})
    assert orjson.loads(raw)["tokens"] == ids
    body = {"messages": CONTINUED, "max_tokens": 4, **flags}
    _, raw = await post(client, "/v1/chat/completions", body)
    reply = orjson.loads(raw)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == expected_output(ids, 4)[1]


async def test_continue_final_message_needs_add_generation_prompt_off(client):
    # add_generation_prompt is true unless set otherwise, as in vLLM.
    for path in ("/v1/chat/completions", "/tokenize"):
        _, raw = await post(client, path, {"messages": CONTINUED, "continue_final_message": True})
        error = error_of(raw, 400)
        assert error["param"] == "continue_final_message"
        assert "add_generation_prompt" in error["message"]


async def test_the_developer_role_reaches_the_template(client):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, raw = await post(client, "/tokenize", {"messages": messages})
    assert orjson.loads(raw)["tokens"] == chat_prompt_ids(messages)
    _, raw = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == len(chat_prompt_ids(messages))


async def test_chat_template_kwargs_reach_the_template_and_may_not_replace_it(
    client, engine, monkeypatch
):
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    )
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    messages = [{"role": "user", "content": "Hi"}]
    tok = make_tokenizer()
    for kwargs, text in (({}, "Hi"), ({"enable_thinking": False}, "Hi /no_think")):
        body = {"messages": messages, "chat_template_kwargs": kwargs}
        _, raw = await post(client, "/tokenize", body)
        assert orjson.loads(raw)["tokens"] == tok.encode(text, add_special_tokens=False)
        _, raw = await post(client, "/v1/chat/completions", {**body, "max_tokens": 1})
        assert orjson.loads(raw)["usage"]["prompt_tokens"] == len(
            tok.encode(text, add_special_tokens=False)
        )
    for reserved in ("chat_template", "tokenize", "messages"):
        body = {"messages": messages, "chat_template_kwargs": {reserved: "{{ 7 * 7 }}"}}
        for path in ("/v1/chat/completions", "/tokenize"):
            _, raw = await post(client, path, body)
            error = error_of(raw, 400)
            assert error["param"] == "chat_template_kwargs" and reserved in error["message"]


async def test_tokenize_returns_the_vocabulary_strings_when_asked(client):
    tok = make_tokenizer()
    for body in ({"prompt": "Hello, world!"}, {"messages": CONTINUED}):
        _, raw = await post(client, "/tokenize", {**body, "return_token_strs": True})
        reply = orjson.loads(raw)
        assert reply["token_strs"] == tok.convert_ids_to_tokens(reply["tokens"])
        _, raw = await post(client, "/tokenize", body)
        assert "token_strs" not in orjson.loads(raw)


async def test_the_server_s_default_template_kwargs_yield_to_the_request_s(
    aiohttp_client, engine, monkeypatch
):
    config = ServerConfig(default_chat_template_kwargs='{"greeting": "Hello", "who": "all"}')
    client = await aiohttp_client(create_app(engine, config))
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ greeting }} {{ who }}")
    tok = make_tokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs, text in (({}, "Hello all"), ({"who": "you"}, "Hello you")):
        body = {"messages": messages, "chat_template_kwargs": kwargs}
        _, raw = await post(client, "/tokenize", body)
        assert orjson.loads(raw)["tokens"] == tok.encode(text, add_special_tokens=False)
        _, raw = await post(client, "/v1/chat/completions", {**body, "max_tokens": 1})
        assert orjson.loads(raw)["usage"]["prompt_tokens"] == len(
            tok.encode(text, add_special_tokens=False)
        )


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("[1]", "must be a JSON object"), ("{", "must be a JSON object"), ('{"tools": 1}', "tools")],
)
def test_default_template_kwargs_are_checked_at_start(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        ServerConfig(default_chat_template_kwargs=text)


async def test_a_request_s_chat_template_needs_the_server_s_trust(client, aiohttp_client, engine):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    documents = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    with_docs = template + "{% for d in documents %}<{{ d.title }}:{{ d.text }}>{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}]
    tok = make_tokenizer()
    for path in ("/v1/chat/completions", "/tokenize"):
        _, raw = await post(client, path, {"messages": messages, "chat_template": template})
        error = error_of(raw, 400)
        assert error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]
    trusting = await aiohttp_client(
        create_app(engine, ServerConfig(trust_request_chat_template=True))
    )
    cases = [
        ({"chat_template": template}, "[Hi]"),
        ({"chat_template": with_docs, "documents": documents}, "[Hi]<A:alpha><B:beta>"),
    ]
    for fields, text in cases:
        ids = tok.encode(text, add_special_tokens=False)
        _, raw = await post(trusting, "/tokenize", {"messages": messages, **fields})
        assert orjson.loads(raw)["tokens"] == ids
        body = {"messages": messages, "max_tokens": 1, **fields}
        _, raw = await post(trusting, "/v1/chat/completions", body)
        assert orjson.loads(raw)["usage"]["prompt_tokens"] == len(ids)
    # A template that fails, and a path instead of a template: 400s naming chat_template.
    recursive = "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"
    for bad, fragment in (
        ("{{ raise_exception('boom') }}", "boom"),
        ("/etc/passwd", "Jinja"),
        ("{{ 1 / 0 }}", "division by zero"),
        ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
        (recursive, "recursion"),
    ):
        body = {"messages": messages, "chat_template": bad, "max_tokens": 1}
        _, raw = await post(trusting, "/v1/chat/completions", body)
        error = error_of(raw, 400)
        assert error["param"] == "chat_template" and fragment in error["message"]
    # Without a chat_template, the model's own renders the request as before.
    _, raw = await post(trusting, "/tokenize", {"messages": messages})
    assert orjson.loads(raw)["tokens"] == chat_prompt_ids(messages)


async def test_a_request_s_chat_template_is_bounded(aiohttp_client, engine):
    """At most 64 KiB of template text; what it writes at most what a template may see; its
    CPU time and memory (engine/template_budget.py's tests) too."""
    from aioinfer.server.serving.prompts import template_char_limit

    trusting = await aiohttp_client(
        create_app(engine, ServerConfig(trust_request_chat_template=True))
    )
    messages = [{"role": "user", "content": "Hi"}]
    large = "{{ messages[0]['content'] }}" + " " * 65536
    limit = template_char_limit(engine.max_model_len)
    for template, fragment in (
        (large, "at most 65536 characters"),
        ("{{ 'y' * " + str(limit + 1) + " }}", f"past its budget of {limit}"),
        ("{% set s = 'x' * 2**31 %}{{ s|length }}", "MiB of memory"),
    ):
        for path in ("/tokenize", "/v1/chat/completions"):
            _, raw = await post(trusting, path, {"messages": messages, "chat_template": template})
            error = error_of(raw, 400)
            assert error["param"] == "chat_template" and fragment in error["message"], error


async def test_a_user_message_without_content_is_a_400_not_a_generation(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        _, raw = await post(client, path, {"messages": messages, "max_tokens": 1})
        error = error_of(raw, 400)
        assert error["param"] == "messages[1].content" and error["type"] == "BadRequestError"


async def test_vllm_fields_for_what_is_not_implemented_are_refused_by_name(client):
    chat = {"messages": CONTINUED[:1], "max_tokens": 1}
    refused = [
        ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2}, "use_beam_search"),
        ("/v1/chat/completions", {**chat, "use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "Hi", "return_tokens_as_token_ids": True, "logprobs": 1},
         "return_tokens_as_token_ids"),
    ]  # fmt: skip
    for path, body, param in refused:
        _, raw = await post(client, path, body)
        error = error_of(raw, 400)
        assert error["param"] == param and "not supported" in error["message"]
    for path, body in (
        ("/v1/chat/completions", {**chat, "echo": False, "use_beam_search": None}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "echo": True}),  # supported there
    ):
        response, raw = await post(client, path, body)
        assert response.status == 200, raw
