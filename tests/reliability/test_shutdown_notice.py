"""--shutdown-notice: on SIGTERM /health turns 503 at once while requests are still served for
the notice period, so that a router that health-checks drops the server before it refuses
anything; a second signal ends the notice early; then the usual drain, and exit 0."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp

from tests.reliability.test_serve_process import serve_args
from tests.support.serve_process import ServeProcess, free_port


async def test_sigterm_with_a_notice_keeps_serving_while_health_turns_503(tiny_model_dir: Path):
    port = free_port()
    proc = ServeProcess(serve_args(tiny_model_dir, port, "--shutdown-notice", "60"))
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    try:
        await asyncio.to_thread(proc.wait_ready)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/health") as response:
                assert response.status == 200
            proc.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            for _ in range(2):  # still so a while later
                async with session.get(f"{base}/health") as response:
                    assert response.status == 503
                    assert "notice period" in (await response.json())["error"]["message"]
                async with session.post(f"{base}/v1/completions", json=body) as response:
                    assert response.status == 200  # still served during the notice
                await asyncio.sleep(0.5)
        proc.proc.send_signal(signal.SIGTERM)  # the second ends the notice: drain, exit
        ended = time.monotonic()
        code, _ = await asyncio.to_thread(proc.wait_exit, 30)
        assert code == 0 and time.monotonic() - ended < 20
        assert any("Shutting down in 60 s (--shutdown-notice)" in line for line in proc.lines)
        assert any("Shutting down: draining" in line for line in proc.lines)
    finally:
        proc.kill()
