"""`aioinfer bench overhead`'s parts on the CPU: the tiny model's folder, the load from a
client process against a real app (the fake engine behind it), the host phases read from
/metrics and divided per token; wrk's script where wrk is installed."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from transformers import AutoTokenizer

from aioinfer.bench import overhead
from aioinfer.engine.stats import HOST_PHASES
from aioinfer.server.app import create_app
from tests.server.conftest import MODEL, build_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return overhead.prepare_model(tmp_path_factory.mktemp("host-overhead"))


def test_the_tiny_model_folder_holds_its_config_and_smollm2s_tokenizer(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config == overhead.TINY_CONFIG
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) >= config["vocab_size"] - 1000
    assert tokenizer.decode(tokenizer("time person")["input_ids"]) == "time person"


def test_per_token_divides_each_phase_by_the_tokens_generated():
    before = {"schedule": 1.0, "apply": 2.0, "tokens": 100.0}
    after = {"schedule": 1.5, "apply": 2.25, "tokens": 1100.0}
    phases = overhead.per_token(before, after)
    assert phases == {"schedule": 500.0, "apply": 250.0, "total": 750.0}
    assert overhead.per_token(after, after) == {}


@pytest.mark.parametrize("client", ["python", "wrk"])
async def test_a_load_run_against_a_real_app_and_its_host_phases(aiohttp_server, client):
    if client == "wrk" and shutil.which("wrk") is None:
        pytest.skip("wrk is not installed")
    engine = await build_engine(max_num_seqs=8)
    try:
        server = await aiohttp_server(create_app(engine))
        base = f"http://127.0.0.1:{server.port}"
        config = overhead.OverheadConfig(duration=1.0, output_len=6, model=MODEL, prompt_words=4)
        load = overhead.run_python_client if client == "python" else overhead.run_wrk
        before = await asyncio.to_thread(overhead.host_seconds, base)
        run = await asyncio.to_thread(load, base, config, 4)
        after = await asyncio.to_thread(overhead.host_seconds, base)
    finally:
        await engine.shutdown()
    assert run.requests > 0 and run.errors == 0
    assert run.output_tokens_per_s == run.requests * 6 / run.seconds
    assert after["tokens"] - before["tokens"] >= run.requests * 6
    assert set(HOST_PHASES) <= set(after)
    phases = overhead.per_token(before, after)
    assert phases["total"] > 0 and phases["http_write"] > 0 and phases["schedule"] > 0
