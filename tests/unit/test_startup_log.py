from __future__ import annotations

import asyncio
import logging
import re
from types import SimpleNamespace

from aioinfer.core.kv_manager import KVCacheManager
from aioinfer.core.scheduler import Scheduler
from aioinfer.startup_log import log_stats_periodically, setup_logging


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
