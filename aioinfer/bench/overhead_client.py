"""The host-overhead load from aiohttp, for machines without wrk: `concurrency` workers send
streamed completions back to back for `duration` seconds. Run as a process of its own by
bench/overhead.py (argument: a JSON object of its settings); prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import aiohttp

from aioinfer.bench.overhead import WORDS


async def worker(session: aiohttp.ClientSession, settings: dict, deadline: float,
                 rng: random.Random, counts: dict[str, int]) -> None:  # fmt: skip
    url = settings["base_url"] + "/v1/completions"
    while time.monotonic() < deadline:
        body = {
            "model": settings["model"],
            "prompt": " ".join(rng.choice(WORDS) for _ in range(settings["prompt_words"])),
            "max_tokens": settings["output_len"],
            "min_tokens": settings["output_len"],
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        async with session.post(url, json=body) as response:
            raw = await response.read()
        ok = response.status == 200 and raw.rstrip().endswith(b"data: [DONE]")
        counts["requests" if ok else "errors"] += 1


async def run(settings: dict) -> dict:
    counts = {"requests": 0, "errors": 0}
    rng = random.Random(settings["seed"])
    start = time.monotonic()
    deadline = start + settings["duration"]
    connector = aiohttp.TCPConnector(limit=settings["concurrency"])
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session, settings, deadline, rng, counts)
                               for _ in range(settings["concurrency"])))  # fmt: skip
    return {**counts, "seconds": time.monotonic() - start}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(json.loads(sys.argv[1])))))
