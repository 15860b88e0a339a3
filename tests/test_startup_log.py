from __future__ import annotations

import asyncio
import logging
import re
from types import SimpleNamespace

from aioinfer.config import CacheConfig, ModelConfig
from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.scheduler import Scheduler
from aioinfer.gpu.runner import RunnerInfo
from aioinfer.startup_log import log_engine_started, log_stats_periodically, setup_logging


async def test_periodic_stats_line_only_while_busy(caplog):
    kv = KVCacheManager(num_blocks=11, block_size=4)
    kv.stats.record(100, 25)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    kv.pool.allocate(5)  # half of the 10 usable blocks in use
    stats = SimpleNamespace(prompt_tokens=0, generation_tokens=0)
    engine = SimpleNamespace(scheduler=scheduler, stats=stats)
    caplog.set_level(logging.INFO, logger="aioinfer")
    task = asyncio.create_task(log_stats_periodically(engine, 0.05))
    try:
        await asyncio.sleep(0.12)
        assert not [r for r in caplog.records if "throughput" in r.getMessage()]  # idle
        stats.prompt_tokens, stats.generation_tokens = 400, 100
        await asyncio.sleep(0.08)
    finally:
        task.cancel()
    [line] = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()][:1]
    assert "Running: 0 reqs, Waiting: 0 reqs" in line
    assert "GPU KV cache usage: 50.0%" in line
    assert "Prefix cache hit rate: 25.0%" in line
    assert "Avg generation throughput:" in line


def test_log_lines_off_a_terminal_are_plain_and_unpadded(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("INFO")  # capsys's stderr is not a terminal
        logging.getLogger("aioinfer").info("KV cache size: %d tokens", 1024)
        logging.getLogger("aiohttp.access").info("GET /health")  # library chatter: dropped
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"\d\d:\d\d:\d\d INFO     KV cache size: 1024 tokens", lines[0])


def test_the_log_level_comes_from_the_environment(capsys, monkeypatch):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    monkeypatch.setenv("AIOINFER_LOGGING_LEVEL", "warning")
    try:
        setup_logging()
        logging.getLogger("aioinfer").info("an info line")
        logging.getLogger("aioinfer").warning("a warning line")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("WARNING  a warning line")


def test_an_unknown_log_level_is_one_error(capsys, monkeypatch):
    from aioinfer.config import SchedulerConfig, ServerConfig
    from aioinfer.server import launch

    async def serve(*args):
        raise AssertionError("the server starts")

    monkeypatch.setattr(launch, "_serve", serve)
    monkeypatch.setenv("AIOINFER_LOGGING_LEVEL", "verbose")
    configs = ModelConfig(), CacheConfig(), SchedulerConfig(), ServerConfig()
    assert launch.run_server(*configs) == 2
    assert capsys.readouterr().err == (
        "Error: AIOINFER_LOGGING_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, got 'verbose'\n"
    )


def _started_engine(default_sampling: dict, **model: object) -> SimpleNamespace:
    info = RunnerInfo(
        served_name="m", device="cpu", dtype="float32", vocab_size=512, max_model_len=64,
        max_num_seqs=4, max_num_batched_tokens=64, num_blocks=9, block_size=16,
        attention_backend="torch", eos_token_ids=(1,), default_sampling=default_sampling,
        weights_load_seconds=0.0, model_load_seconds=0.0, weights_gib=0.0, available_kv_gib=0.0,
        graphs_off_reason="on the CPU",
    )  # fmt: skip
    return SimpleNamespace(
        info=info,
        model_config=ModelConfig(model="m", **model),
        cache_config=CacheConfig(),
        model_name="m",
        default_sampling=default_sampling,
    )


def test_sampling_defaults_are_logged_under_their_source(caplog, tmp_path):
    """The model's generation config changing the defaults unasked is a warning (as in vLLM);
    what --override-generation-config set is not the model's, and was asked for."""
    caplog.set_level(logging.INFO, logger="aioinfer")
    overrides = '{"temperature": 0.2, "max_new_tokens": 64}'
    defaults = {"temperature": 0.2, "top_p": 0.8, "max_tokens": 64}  # top_p: the model's
    log_engine_started(_started_engine(defaults, override_generation_config=overrides))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "sampling" in r.getMessage()]
    assert lines == [
        (
            "WARNING",
            "Default sampling parameters have been overridden by the model's generation "
            "config: {'top_p': 0.8} (--generation-config vllm ignores it)",
        ),
        (
            "INFO",
            "Default sampling parameters set by --override-generation-config: "
            "{'temperature': 0.2, 'max_tokens': 64}",
        ),
    ]

    caplog.clear()  # a folder given to --generation-config was asked for: no warning
    (tmp_path / "generation_config.json").write_text("{}")
    log_engine_started(_started_engine({"top_p": 0.8}, generation_config=str(tmp_path)))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "sampling" in r.getMessage()]
    assert lines == [
        (
            "INFO",
            f"Default sampling parameters set by the generation config in {tmp_path}: "
            "{'top_p': 0.8}",
        )
    ]

    caplog.clear()
    asked_only = {"temperature": 0.2, "max_tokens": 64}  # the model's config sets nothing
    log_engine_started(_started_engine(asked_only, override_generation_config=overrides))
    assert not [r for r in caplog.records if "model's generation config" in r.getMessage()]
