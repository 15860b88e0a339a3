"""What routers, autoscalers and the endpoint picker read of a backend: the engine's series
under either prefix (the picker's five families with vLLM's types and labels), /is_sleeping,
/server_info, and an HTTP/2 (gRPC) probe answered with one quiet line."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from aioinfer.server.http.probes import ProbeFilter
from tests.server.conftest import MODEL, build_engine

# The endpoint picker's families (llm-d's core-metrics-extractor), with their types.
PICKER = {
    "num_requests_waiting": "gauge",
    "num_requests_running": "gauge",
    "kv_cache_usage_perc": "gauge",
    "lora_requests_info": "gauge",
    "cache_config_info": "gauge",
}


async def families(client) -> dict:
    response = await client.get("/metrics")
    assert response.status == 200
    return {f.name: f for f in text_string_to_metric_families((await response.read()).decode())}


@pytest.mark.parametrize("prefix", ["aioinfer", "vllm"])
async def test_the_picker_reads_its_five_families_under_either_prefix(aiohttp_client, prefix):
    """With --max-num-seqs 1 and three requests in flight: one runs, two wait. No family is
    exported twice: the other prefix names nothing of the engine's."""
    engine = await build_engine(step_delay=0.05, max_num_seqs=1)
    engine.model_config = engine.model_config.__class__(
        **{**engine.model_config.__dict__, "enable_lora": True}
    )
    try:
        config = ServerConfig(metrics_prefix=prefix)
        client = await aiohttp_client(create_app(engine, config))
        body = {"prompt": [5, 6, 7], "max_tokens": 30}
        posts = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)]
        await asyncio.sleep(0.3)
        found = await families(client)
        for task in posts:
            (await task).release()
    finally:
        await engine.shutdown()
    other = "vllm" if prefix == "aioinfer" else "aioinfer"
    assert not [name for name in found if name.startswith(f"{other}:")]
    for metric, kind in PICKER.items():
        family = found[f"{prefix}:{metric}"]
        assert family.type == kind, metric
    value = {m: found[f"{prefix}:{m}"].samples[0] for m in PICKER}
    assert value["num_requests_running"].value == 1
    assert value["num_requests_waiting"].value == 2
    assert 0.0 < value["kv_cache_usage_perc"].value <= 1.0
    cache = value["cache_config_info"].labels
    assert cache["block_size"] == str(engine.cache_config.block_size)
    assert int(cache["num_gpu_blocks"]) == engine.scheduler.kv.pool.num_blocks
    lora = value["lora_requests_info"]
    assert {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= set(lora.labels)
    assert abs(lora.value - time.time()) < 60  # vLLM's: the time of the scrape
    assert f"{prefix}:generation_tokens" in found  # counters keep their _total samples
    assert found[f"{prefix}:generation_tokens"].samples[0].name == (
        f"{prefix}:generation_tokens_total"
    )


def test_a_prefix_other_than_the_two_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="metrics_prefix must be one of aioinfer, vllm"):
        ServerConfig(metrics_prefix="sglang")


async def test_is_sleeping_and_server_info(aiohttp_client, engine):
    client = await aiohttp_client(create_app(engine))
    response = await client.get("/is_sleeping")
    assert response.status == 200 and await response.json() == {"is_sleeping": False}
    for path in ("/server_info", "/get_server_info"):
        response = await client.get(path)
        assert response.status == 200
        info = await response.json()
        assert info["served_model_name"] == MODEL
        assert info["max_model_len"] == engine.max_model_len
        assert info["max_total_tokens"] == (
            (engine.info.num_blocks - 1) * engine.cache_config.block_size
        )


async def test_an_http2_probe_is_one_info_line_without_a_traceback(aiohttp_server, engine, caplog):
    server = await aiohttp_server(create_app(engine))
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9))
    await writer.drain()
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        answer = await asyncio.wait_for(reader.read(100), 5)
        writer.close()
        await asyncio.sleep(0.05)
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 1
    record = records[0]
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == (
        "127.0.0.1 opened an HTTP/2 (gRPC) connection; this server speaks HTTP/1.1 (400)"
    )


def test_the_probe_filter_leaves_other_errors_alone():
    try:
        raise ValueError("a real bug")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
            ("1.2.3.4",), sys.exc_info(),
        )  # fmt: skip
    assert ProbeFilter().filter(record)
    assert record.levelno == logging.ERROR and record.exc_info is not None
