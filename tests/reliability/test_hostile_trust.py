"""What a client may make the server keep, log or show: field names it made up, request ids,
other keys' cached prompts, adapters' paths and runtime LoRA paths. Each is bounded, escaped,
refused or kept apart, through the real app over the fake engine."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import AsyncIterator

import orjson
import pytest

from aioinfer.config import ServerConfig
from aioinfer.core.pooling import PoolerConfig
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from aioinfer.server.http.bodies import MiB
from aioinfer.server.http.state import STATE
from aioinfer.server.responses.state import RESPONSES
from tests.server.conftest import BLOCK_SIZE, assert_pool_free, build_engine

JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = await build_engine()
    yield eng
    await eng.shutdown()


def remembered_bytes(logged: set[tuple[str, str]]) -> int:
    """What the remembered field names hold in memory: the set, its tuples and their strings."""
    strings = {id(s): sys.getsizeof(s) for entry in logged for s in entry}
    return sys.getsizeof(logged) + sum(sys.getsizeof(e) for e in logged) + sum(strings.values())


async def test_a_huge_made_up_field_name_is_clipped_in_the_log_and_in_memory(
    aiohttp_client, engine, caplog
):
    """A field name as long as the body was logged in full and kept for the process's life
    (4 MiB a request, from cheap /tokenize calls). Now it is logged and remembered as a
    clipped repr; many long names stop at a bound in characters, not only in count."""
    client = await aiohttp_client(create_app(engine, ServerConfig()))
    caplog.set_level(logging.WARNING, logger="aioinfer.server")
    body = orjson.dumps({"prompt": "a", "a" * (4 * MiB): 1, "x\nFORGED": 2})
    response = await client.post("/tokenize", data=body, headers=JSON)
    assert response.status == 200
    [line] = [r.getMessage() for r in caplog.records if "but ignored" in r.getMessage()]
    assert len(line.encode()) < 1024 and "\n" not in line and "FORGED" in line
    logged = client.app[STATE].ignored_fields_logged
    assert len(logged) == 2 and remembered_bytes(logged) < 64 * 1024

    # Thousands of long names, distinct where the clip keeps them: bounded in bytes too.
    names = {f"{i:06d}" + "b" * 2000 + f"{i:06d}": 0 for i in range(2000)}
    response = await client.post("/tokenize", data=orjson.dumps({"prompt": "a", **names}),
                                 headers=JSON)  # fmt: skip
    assert response.status == 200
    assert remembered_bytes(logged) < 64 * 1024
    assert "the last such warning" in caplog.records[-1].getMessage()
    assert_pool_free(engine)


FORGED = "2026-12-07 00:00:00 INFO aioinfer: FORGED admin login ok"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_request_id_that_could_forge_a_log_line_is_refused(
    aiohttp_client, engine, caplog, path
):
    """The body's request_id reached the request log and "client left; aborted ..." raw: a
    newline in it forged a second log line. Ids are printable ASCII without spaces, at most
    256 characters: anything else is a 400 naming the field (or the header), before any work."""
    config = ServerConfig(log_requests=True)
    client = await aiohttp_client(create_app(engine, config))
    caplog.set_level(logging.DEBUG)
    body: dict = {"max_tokens": 2}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    for bad in (f"x\n{FORGED}", f"x\r{FORGED}", "x\x1b[2J", "a b", "é", "x" * 257):
        response = await client.post(path, json={**body, "request_id": bad})
        error = (await response.json())["error"]
        assert response.status == 400 and error["param"] == "request_id", bad
        assert "printable ASCII" in error["message"]
    for bad in ("a b", "é", "x" * 257):
        response = await client.post(path, json=body, headers={"X-Request-Id": bad})
        error = (await response.json())["error"]
        assert response.status == 400 and error["param"] == "X-Request-Id", bad
        assert "X-Request-Id" not in response.headers
    ok = "trace-" + "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\')[:200]
    response = await client.post(path, json={**body, "request_id": ok})
    assert response.status == 200 and (await response.json())["id"].endswith(ok)
    response = await client.post(path, json=body, headers={"X-Request-Id": ok})
    assert response.status == 200 and response.headers["X-Request-Id"] == ok
    messages = [r.getMessage() for r in caplog.records]
    assert any(ok in m for m in messages)  # the request log names the accepted id
    assert not [m for m in messages if "FORGED" in m or "\x1b" in m]
    assert_pool_free(engine)


@pytest.mark.parametrize("named", [True, False])
async def test_adapters_show_their_names_not_their_server_paths(aiohttp_client, named):
    """/v1/models showed each adapter's folder on the server as its `root`; it shows its name.
    /metrics (no key) names the adapters of running and waiting requests, as vLLM's
    lora_requests_info does, unless --no-lora-names-in-metrics puts adapter-<slot> instead."""
    engine = await build_engine(step_delay=0.05, max_num_seqs=1)
    engine.model_config = dataclasses.replace(engine.model_config, enable_lora=True)
    path = "/srv/private/adapters/sql-v3"
    engine.loras.slots["sql"], engine.loras.paths["sql"] = 1, path  # as add_lora leaves them
    try:
        config = ServerConfig(api_key=("k",), lora_names_in_metrics=named)
        client = await aiohttp_client(create_app(engine, config))
        auth = {"Authorization": "Bearer k"}
        response = await client.get("/v1/models", headers=auth)
        text = await response.text()
        assert response.status == 200 and path not in text and "private" not in text
        cards = {card["id"]: card for card in orjson.loads(text)["data"]}
        assert cards["sql"]["root"] == "sql" and cards["sql"]["parent"] == engine.model_name
        card = await (await client.get("/v1/models/sql", headers=auth)).json()
        assert card["root"] == "sql"

        body = {"model": "sql", "prompt": [5, 6, 7], "max_tokens": 20}
        posts = [
            asyncio.ensure_future(client.post("/v1/completions", json=body, headers=auth))
            for _ in range(2)
        ]
        await asyncio.sleep(0.3)
        metrics = await (await client.get("/metrics")).text()  # no key needed
        for task in posts:
            assert (await task).status == 200
    finally:
        await engine.shutdown()
    [line] = [ln for ln in metrics.splitlines() if ln.startswith("aioinfer:lora_requests_info{")]
    shown = "sql" if named else "adapter-1"
    assert f'running_lora_adapters="{shown}"' in line and f'waiting_lora_adapters="{shown}"' in line
    assert ("sql" in metrics) is named and path not in metrics


async def test_runtime_lora_paths_stay_under_the_lora_root(
    aiohttp_client, engine, monkeypatch, tmp_path, caplog
):
    """Runtime loading took any server path, and its errors told whether adapter_config.json
    and the weights existed there. Now a lora_path must lie under --lora-root (symlinks
    resolved, relative paths taken from it), without the flag every path is refused, and every
    path that fails gets the same message, which names no file."""
    monkeypatch.setenv("AIOINFER_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine.model_config = dataclasses.replace(engine.model_config, enable_lora=True)
    root, outside = tmp_path / "adapters", tmp_path / "private"
    for folder in (root / "sql", outside / "secret"):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")
    (root / "escape").symlink_to(outside / "secret")
    (root / "not-an-adapter").mkdir()
    loaded: list[str] = []

    async def add_lora(lora):  # the engine's, without weights: a folder with a config loads
        if not os.path.isfile(os.path.join(lora.lora_path, "adapter_config.json")):
            raise ValueError(
                f"{lora.lora_path} is not a LoRA adapter: it needs adapter_config.json"
            )
        loaded.append(lora.lora_path)
        engine.loras.slots[lora.lora_name] = lora.lora_int_id
        engine.loras.paths[lora.lora_name] = lora.lora_path

    monkeypatch.setattr(engine, "add_lora", add_lora)

    async def load(client, name: str, path: str) -> tuple[int, dict | str]:
        response = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        )
        if response.status == 200:
            return 200, await response.text()
        return response.status, (await response.json())["error"]

    closed = await aiohttp_client(create_app(engine, ServerConfig()))
    status, error = await load(closed, "sql", str(root / "sql"))
    assert status == 400 and "--lora-root" in error["message"] and loaded == []

    client = await aiohttp_client(create_app(engine, ServerConfig(lora_root=str(root))))
    messages = set()
    for i, path in enumerate(
        [
            str(outside / "secret"),  # an adapter, but outside the root
            str(root / ".." / "private" / "secret"),
            "../private/secret",
            str(root / "escape"),  # a symlink out of the root
            "escape",
            "/etc/passwd",
            "/nonexistent/folder",
            str(root / "missing"),
            "not-an-adapter",
            "sql\x00",
            "a" * 100_000 + "\nFORGED",  # the log shows it escaped and clipped
            "/" + "b" * 100_000,
        ]
    ):
        status, error = await load(client, f"bad-{i}", path)
        assert status == 400 and error["param"] == "lora_path", path
        messages.add(error["message"].replace(f"'bad-{i}'", "NAME"))
    [message] = messages  # one message whatever the reason
    for word in ("passwd", "private", "secret", "exist", "adapter_config", str(tmp_path)):
        assert word not in message
    assert loaded == []
    assert all("\n" not in r.getMessage() for r in caplog.records)
    assert all(len(r.getMessage()) < 1024 for r in caplog.records)

    assert (await load(client, "sql", "sql"))[0] == 200
    assert (await load(client, "sql-abs", str(root / "sql")))[0] == 200
    assert loaded == [str((root / "sql").resolve())] * 2


@pytest.mark.parametrize("share", [False, True])
async def test_with_several_keys_each_key_caches_its_own_prefixes(aiohttp_client, engine, share):
    """Keys were separate owners of stored responses but shared the prefix cache: one key's
    client read another's prompts from cached_tokens (or the time to its first token), a
    block at a time. With several keys each key's prompts are cached under a root of its own,
    a client's cache_salt within it; --share-prefix-cache-across-keys shares them again."""
    config = ServerConfig(
        api_key=("key-a", "key-b"),
        enable_prompt_tokens_details=True,
        share_prefix_cache_across_keys=share,
    )
    client = await aiohttp_client(create_app(engine, config))
    prompt = list(range(7, 7 + 64))

    async def cached(key: str, salt: str | None = None, route: str = "/v1/completions") -> int:
        body: dict = {"max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        if route == "/v1/completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": "the same words " * 8}]
        headers = {"Authorization": f"Bearer {key}"}
        response = await client.post(route, json=body, headers=headers)
        assert response.status == 200
        return (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    full = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # one token is always computed
    assert await cached("key-a") == 0
    assert await cached("key-b") == (full if share else 0)
    assert await cached("key-a") == full  # the same key hits
    assert await cached("key-b") == full
    # A client's salt separates within its key, and never reaches another key's prefixes.
    assert await cached("key-a", salt="s") == 0
    assert await cached("key-b", salt="s") == (full if share else 0)
    assert await cached("key-a", salt="s") == full
    chat = "/v1/chat/completions"  # chat renders its prompt, then caches it alike
    assert await cached("key-a", route=chat) == 0
    assert (await cached("key-b", route=chat) > 0) is share
    assert await cached("key-a", route=chat) > 0
    assert_pool_free(engine)


async def test_embeddings_of_several_keys_are_cached_apart_too(aiohttp_client, monkeypatch):
    """A pooling model of LAST pooling reuses cached prefixes as well (its time shows them)."""
    engine = await build_engine(pooler=PoolerConfig("LAST"))
    salts: list[str | None] = []
    add = engine.add_pooling_request

    def recording(*args, **kwargs):
        salts.append(kwargs.get("cache_salt"))
        return add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_pooling_request", recording)
    try:
        for share in (False, True):
            config = ServerConfig(api_key=("key-a", "key-b"), share_prefix_cache_across_keys=share)
            client = await aiohttp_client(create_app(engine, config))
            for key in ("key-a", "key-b", "key-a"):
                response = await client.post(
                    "/v1/embeddings",
                    json={"input": "the same words"},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert response.status == 200
    finally:
        await engine.shutdown()
    a, b, a_again, *shared = salts
    assert a is not None and a != b and a == a_again
    assert shared == [None, None, None]


async def test_a_path_in_the_log_of_an_unhandled_error_is_escaped_and_clipped(
    aiohttp_client, engine, monkeypatch, caplog
):
    """The log line of an unhandled error (a 500) named the request's path as the client sent
    it, percent-decoded: a newline in it forged a line, and its length was the client's."""
    client = await aiohttp_client(create_app(engine, ServerConfig()))

    def broken(*args: object) -> None:
        raise RuntimeError("store lost")

    monkeypatch.setattr(client.server.app[RESPONSES].store, "get", broken)
    caplog.set_level(logging.ERROR)
    response = await client.get("/v1/responses/" + "r" * 5000 + "%0A" + FORGED.replace(" ", "%20"))
    assert response.status == 500
    [line] = [r.getMessage() for r in caplog.records if "unhandled error" in r.getMessage()]
    assert "\n" not in line and len(line) < 512
