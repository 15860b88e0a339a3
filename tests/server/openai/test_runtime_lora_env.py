"""Runtime LoRA loading is switched on by our variable or, as Helm charts set it, vLLM's."""

from __future__ import annotations

import pytest

from aioinfer.server.app import create_app
from aioinfer.server.openai.lora import (
    RUNTIME_LORA_ENV,
    VLLM_RUNTIME_LORA_ENV,
    runtime_lora_updating,
)


@pytest.mark.parametrize(
    ("ours", "vllms", "on"),
    [
        (None, None, False),
        (None, "True", True),
        (None, "1", True),
        (None, "false", False),
        ("true", None, True),
        ("0", "true", False),  # ours, when set, decides
        ("1", "false", True),
    ],
)
def test_ours_or_vllms_variable_switches_it_on(monkeypatch, ours, vllms, on):
    for name, value in ((RUNTIME_LORA_ENV, ours), (VLLM_RUNTIME_LORA_ENV, vllms)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert runtime_lora_updating() is on


async def test_vllms_variable_serves_the_load_route(monkeypatch, aiohttp_client, engine):
    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    monkeypatch.setenv(VLLM_RUNTIME_LORA_ENV, "True")
    client = await aiohttp_client(create_app(engine))
    response = await client.post("/v1/load_lora_adapter", json={})
    assert response.status == 400  # routed: the body names no adapter
    monkeypatch.delenv(VLLM_RUNTIME_LORA_ENV)
    client = await aiohttp_client(create_app(engine))
    response = await client.post("/v1/load_lora_adapter", json={})
    assert response.status == 404
