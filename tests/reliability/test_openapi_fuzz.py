"""Schemathesis against /openapi.json: generated requests (valid and invalid by the schema) to
every route of the live server over the fake engine. No response may be a 5xx, carry an
undocumented status or content type, or break its schema; invalid requests must be refused,
in OpenAI's error shape naming the field. Then hypothesis draws the hostile clients' bodies
that a schema does not describe (request ids with control characters, schemas deep or costly
as text, huge n, prompt logprobs past their bound, messages without content or too many of
them, long made-up field names): each is answered by name, never a 5xx. Afterwards nothing
is left in the engine and every KV block is free."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

schemathesis = pytest.importorskip("schemathesis")

import requests  # noqa: E402  (a dependency of schemathesis)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from aioinfer import __version__  # noqa: E402
from aioinfer.config import ServerConfig  # noqa: E402
from aioinfer.core.sampling_params import (  # noqa: E402
    MAX_OBJECT_OPTIONAL_PROPERTIES,
    MAX_SCHEMA_BOUNDS,
    MAX_SCHEMA_DEPTH,
)
from aioinfer.server.http.bodies import (  # noqa: E402
    MAX_IGNORED_FIELD_CHARS_REMEMBERED,
    MAX_IGNORED_FIELDS_REMEMBERED,
)
from aioinfer.server.http.state import STATE  # noqa: E402
from aioinfer.server.http.validation import REQUEST_ID  # noqa: E402
from aioinfer.server.openapi import openapi_document  # noqa: E402
from aioinfer.server.serving.generation import (  # noqa: E402
    MAX_N,
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_SEQUENCES_PER_REQUEST,
)
from aioinfer.server.serving.protocol import MAX_CHAT_MESSAGES  # noqa: E402
from tests.core.test_sampling_params import an_object, ranged_schema  # noqa: E402
from tests.reliability.conftest import ThreadedServer  # noqa: E402
from tests.server.conftest import MAX_MODEL_LEN, assert_pool_free  # noqa: E402

MAX_EXAMPLES = 25  # per route and generation mode: bounded, about 20 s in all on 2 cores


@schemathesis.check
def refusals_name_their_field(ctx, response, case) -> bool | None:
    """A 400 for a JSON object body is an error in OpenAI's shape whose `param` names the
    field it refuses (Anthropic's envelope, on /v1/messages, names it in its message)."""
    if response.status_code != 400 or not isinstance(case.body, dict):
        return None
    sent = response.request.headers.get("Content-Type", "")
    if not sent.startswith("application/json"):  # a content-type probe: refused as a whole
        return None
    error = response.json()["error"]
    assert isinstance(error.get("message"), str) and error["message"], error
    if case.path.startswith("/v1/messages"):
        assert error["type"] == "invalid_request_error", error
        return None
    assert error.get("param"), f"{case.method} {case.path}: a 400 naming no field: {error}"
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    refusals_name_their_field,
]

schema = schemathesis.openapi.from_dict(openapi_document(__version__))
# The server requires a key, as the document says; every case carries the right one (the key
# checks themselves are in tests/server).
schema.config.generation.update(
    modes=["positive", "negative"],
    max_examples=MAX_EXAMPLES,
    allow_x00=False,
    with_security_parameters=False,
)
KEY = "fuzz-key"


@pytest.fixture(scope="module")
def keyed_server():
    server = ThreadedServer(ServerConfig(api_key=(KEY,))).start()
    yield server
    server.stop()


def test_the_served_document_is_the_one_fuzzed(keyed_server: ThreadedServer) -> None:
    url = f"{keyed_server.url}/openapi.json"
    served = requests.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert served == orjson.loads(orjson.dumps(openapi_document(__version__)))
    assert {"/v1/completions", "/v1/chat/completions", "/health"} <= set(served["paths"])


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(case, keyed_server: ThreadedServer) -> None:
    case.call_and_validate(
        base_url=keyed_server.url,
        headers={"Authorization": f"Bearer {KEY}"},
        checks=CHECKS,
        timeout=30,
    )


# ------------------------------------------------------------------ hostile clients' bodies

HOSTILE_EXAMPLES = 100  # about 6 s on 2 cores
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 1}
MAX_LOGPROBS = 20  # the server's default --max-logprobs


@dataclass
class Hostile:
    """A request and how it must be answered: `param` names the refused field (None: 200)."""

    path: str
    body: dict[str, Any]
    param: str | None
    headers: dict[str, str] | None = None


@st.composite
def request_ids(draw: st.DrawFn) -> Hostile:
    """Ids with control characters, spaces, other scripts or past 256 characters: a 400
    naming the field or the header (printable ASCII ones are taken)."""
    path, base = draw(
        st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
    )
    if draw(st.booleans()):
        rid = draw(st.text(min_size=1, max_size=300))
        ok = REQUEST_ID.fullmatch(rid) is not None
        return Hostile(path, {**base, "request_id": rid}, None if ok else "request_id")
    # A header's bytes: what an HTTP client lets through (no CR, LF or other controls).
    latin1 = st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f")
    rid = draw(st.text(latin1, min_size=1, max_size=300))
    ok = REQUEST_ID.fullmatch(rid) is not None
    return Hostile(path, base, None if ok else "X-Request-Id", {"X-Request-Id": rid})


@st.composite
def deep_schemas(draw: st.DrawFn) -> Hostile:
    """Schemas as JSON text, nested past the limit (once 46 s to compile, or a 500)."""
    path, base = draw(
        st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
    )
    depth = draw(st.integers(MAX_SCHEMA_DEPTH, 3000))
    nested = '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth
    text = draw(st.sampled_from([nested, "[" * depth + "]" * depth]))
    return Hostile(path, {**base, "structured_outputs": {"json": text}}, "structured_outputs")


@st.composite
def costly_schemas(draw: st.DrawFn) -> Hostile:
    """Schemas past their numeric bounds or optional properties, as objects or as text."""
    path, base = draw(
        st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
    )
    if draw(st.booleans()):
        schema = ranged_schema(draw(st.integers(MAX_SCHEMA_BOUNDS // 2 + 1, 700)))
    else:
        schema = an_object(draw(st.integers(MAX_OBJECT_OPTIONAL_PROPERTIES + 1, 3000)))
    spec = json.dumps(schema) if draw(st.booleans()) else schema
    if "chat" in path and draw(st.booleans()):
        format_ = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        return Hostile(path, {**base, "response_format": format_}, "response_format")
    return Hostile(path, {**base, "structured_outputs": {"json": spec}}, "structured_outputs")


@st.composite
def huge_n(draw: st.DrawFn) -> Hostile:
    """n past 256, or prompts x n past 4096 sequences."""
    if draw(st.booleans()):
        n = draw(st.one_of(st.integers(MAX_N + 1, 10**6), st.integers(10**6, 10**30)))
        path, base = draw(
            st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
        )
        return Hostile(path, {**base, "n": n}, "n")
    prompts = draw(st.integers(MAX_SEQUENCES_PER_REQUEST // MAX_N + 1, 64))
    n = MAX_SEQUENCES_PER_REQUEST // prompts + 1
    return Hostile(
        "/v1/completions", {**COMPLETION, "prompt": [[5, 6]] * prompts, "n": n}, "prompt"
    )


@st.composite
def logprob_floods(draw: st.DrawFn) -> Hostile:
    """Prompt logprobs past 131072 entries: by n with prompt_logprobs, or echoed prompts."""
    length = draw(st.integers(100, MAX_MODEL_LEN - 8))
    k = draw(st.integers(10, MAX_LOGPROBS))
    prompt = [5 + i % 50 for i in range(length)]
    copies = MAX_PROMPT_LOGPROB_ENTRIES // (length * (k + 1)) + 1
    if draw(st.booleans()):
        body = {"prompt": prompt, "n": copies, "prompt_logprobs": k, "max_tokens": 1}
        return Hostile("/v1/completions", body, "prompt_logprobs")
    body = {"prompt": [prompt] * copies, "echo": True, "logprobs": k, "max_tokens": 0}
    return Hostile("/v1/completions", body, "logprobs")


@st.composite
def contentless(draw: st.DrawFn) -> Hostile:
    """A conversation in which a message has no content (an assistant's without tool calls
    neither): a 400 naming the first such message's content."""
    roles = st.sampled_from(["system", "developer", "user", "assistant"])
    messages = draw(
        st.lists(
            st.fixed_dictionaries({"role": roles}, optional={"content": st.text(max_size=20)}),
            min_size=1,
            max_size=6,
        )
    )
    missing = [i for i, m in enumerate(messages) if "content" not in m]
    if not missing:
        at = draw(st.integers(0, len(messages) - 1))
        messages[at] = {"role": draw(roles)}
        missing = [at]
    path = draw(st.sampled_from(["/v1/chat/completions", "/tokenize"]))
    body = {"messages": messages, "max_tokens": 1}
    return Hostile(path, body, f"messages[{missing[0]}].content")


@st.composite
def many_messages(draw: st.DrawFn) -> Hostile:
    """Conversations past 10,000 messages (items on /v1/responses)."""
    count = draw(st.integers(MAX_CHAT_MESSAGES + 1, MAX_CHAT_MESSAGES + 2000))
    path = draw(st.sampled_from(["/v1/chat/completions", "/tokenize", "/v1/responses"]))
    if path == "/v1/responses":
        items = [{"type": "message", "role": "user", "content": ""}] * count
        return Hostile(path, {"input": items, "max_output_tokens": 1}, "input")
    return Hostile(path, {"messages": [{"role": "user", "content": ""}] * count}, "messages")


@st.composite
def made_up_names(draw: st.DrawFn) -> Hostile:
    """Fields of made-up names, some long or with control characters: ignored, served."""
    names = draw(
        st.lists(
            st.one_of(
                st.text(min_size=1, max_size=200), st.integers(1, 100_000).map(lambda k: "x\n" * k)
            ),
            min_size=1,
            max_size=4,
        )
    )
    path, base = draw(
        st.sampled_from(
            [
                ("/v1/completions", COMPLETION),
                ("/v1/chat/completions", CHAT),
                ("/tokenize", {"prompt": "hi"}),
            ]
        )
    )
    extra = {name: 1 for name in names if name not in base and name not in KNOWN_FIELDS}
    return Hostile(path, {**base, **extra}, None)


KNOWN_FIELDS = frozenset(
    name
    for schema in openapi_document(__version__)["components"]["schemas"].values()
    for name in schema.get("properties", {})
)
HOSTILE = st.one_of(
    request_ids(),
    deep_schemas(),
    costly_schemas(),
    huge_n(),
    logprob_floods(),
    contentless(),
    many_messages(),
    made_up_names(),
)


@given(HOSTILE)
@settings(
    max_examples=HOSTILE_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_hostile_bodies_are_answered_by_name(
    keyed_server: ThreadedServer, hostile: Hostile
) -> None:
    headers = {"Authorization": f"Bearer {KEY}", **(hostile.headers or {})}
    response = requests.post(
        f"{keyed_server.url}{hostile.path}", json=hostile.body, headers=headers, timeout=60
    )
    assert response.status_code < 500, response.text[:500]
    if hostile.param is None:
        assert response.status_code == 200, response.text[:500]
        return
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400, error
    assert error["param"] == hostile.param, error
    assert isinstance(error["message"], str) and 0 < len(error["message"]) < 2000, error


def test_the_fuzzed_server_kept_nothing(keyed_server: ThreadedServer) -> None:
    """After every case above: no request left in the engine, every KV block free, and the
    made-up field names remembered for the log within their bounds."""
    engine = keyed_server.engine
    assert engine is not None and keyed_server.server is not None

    async def settled() -> None:
        for _ in range(500):
            if engine.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        assert_pool_free(engine)

    keyed_server.run(settled())
    logged = keyed_server.server.app[STATE].ignored_fields_logged
    assert len(logged) <= MAX_IGNORED_FIELDS_REMEMBERED
    assert sum(len(name) for _, name in logged) <= MAX_IGNORED_FIELD_CHARS_REMEMBERED + 100
