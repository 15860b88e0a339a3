"""Schemathesis against /openapi.json: generated requests (valid and invalid by the schema) to
every route of the live server over the fake engine. No response may be a 5xx, carry an
undocumented status or content type, or break its schema; invalid requests must be refused."""

from __future__ import annotations

import orjson
import pytest

schemathesis = pytest.importorskip("schemathesis")

import requests  # noqa: E402  (a dependency of schemathesis)
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
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
from aioinfer.server.openapi import openapi_document  # noqa: E402
from tests.reliability.conftest import ThreadedServer  # noqa: E402

MAX_EXAMPLES = 25  # per route and generation mode: bounded, about 20 s in all on 2 cores
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
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
