"""aioinfer behind the routers that spread requests over replicas, end to end: two `aioinfer
serve` processes on a tiny random model, each on a free 127.0.0.1 port, behind sglang-router
(policy cache_aware) and vllm-router (policy consistent_hash), both run from their PyPI wheels
with every listener on 127.0.0.1 and a free port.

Which backend served a request is read from the backends' own /metrics (the growth of
`aioinfer:request_success_total`), never from a router's internals. The tests of a router skip
when its wheel is not installed (pyproject's `test` extra installs both); they are marked
`routers`, which the README's `make test` runs.

The two backends are shared by the whole module; the drain test comes last because it ends
backend 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serve_process import ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
NOTICE = 5  # seconds of --shutdown-notice: a router that checks every second drops the backend
READY_TIMEOUT = 240.0  # two servers loading at once on a busy 2-core machine
ROUTER_TIMEOUT = 120.0  # a router lists both backends healthy
SETTLE_TIMEOUT = 30.0  # a finished request shows in the counters
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=120)

SUCCESS = "aioinfer:request_success_total"
HITS = "aioinfer:prefix_cache_hits_total"
QUERIES = "aioinfer:prefix_cache_queries_total"
GRPC_PROBE = "opened an HTTP/2 (gRPC) connection"

ROUTER_WHEELS = ("sglang-router", "vllm-router")
needs_sglang_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)
needs_vllm_router = pytest.mark.skipif(
    importlib.util.find_spec("vllm_router") is None, reason="vllm-router is not installed"
)


# --------------------------------------------------------------------------- the suite's command


def test_the_readme_test_command_runs_the_router_tests(pytestconfig: pytest.Config):
    """`make test` runs pytest with pyproject's settings and no `-m`: the `routers` marker is
    registered, nothing deselects it, and the test extra installs both routers."""
    assert any(m.startswith("routers:") for m in pytestconfig.getini("markers"))
    addopts = " ".join(pytestconfig.getini("addopts"))
    assert "routers" not in addopts and not re.search(r"(^| )-m", addopts), addopts
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    run = re.search(r"\bpytest\b(.*)", recipe[1]) if recipe else None
    assert run, "the Makefile's test recipe runs no pytest"
    assert "routers" not in run[1] and not re.search(r"(^| )-m\b", run[1]), run[0]
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    with (ROOT / "pyproject.toml").open("rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    for wheel in ROUTER_WHEELS:
        assert any(re.match(rf"{wheel}\b", requirement) for requirement in extra), extra


# --------------------------------------------------------------------------- backends


@dataclass
class Backend:
    process: ServeProcess
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """SIGTERM, and a second one to end the notice: with nothing in flight, exit at once."""
        proc = self.process.proc
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            self.process.wait_exit(30)
        finally:
            self.process.kill()


def start_backends(model_dir: Path, count: int) -> list[Backend]:
    """`count` servers started at once (each on one thread: they share two cores), all ready."""
    backends: list[Backend] = []
    try:
        for _ in range(count):
            port = free_port()
            args = [str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                    "--device", "cpu", "--served-model-name", MODEL, "--kv-cache-memory", "0.01",
                    "--log-stats-interval", "0", "--shutdown-notice", str(NOTICE)]  # fmt: skip
            backends.append(Backend(ServeProcess(args, env={"OMP_NUM_THREADS": "1"}), port))
        for backend in backends:
            backend.process.wait_ready(READY_TIMEOUT)
    except BaseException:
        for backend in backends:
            backend.process.kill()
        raise
    return backends


@pytest.fixture(scope="module")
def backends(tiny_model_dir: Path) -> Iterator[list[Backend]]:
    # The native CPU kernels built here, once, into the session's $AIOINFER_CACHE, which the
    # servers inherit: else each server builds them at the same time (10-40 s on two cores).
    from aioinfer.model.cpu import kernels

    kernels.load()
    started = start_backends(tiny_model_dir, 2)
    try:
        yield started
    finally:
        for backend in started:
            with contextlib.suppress(subprocess.TimeoutExpired):  # killed regardless
                backend.stop()


def assert_running(backends: list[Backend]) -> None:
    for i, backend in enumerate(backends):
        assert backend.process.proc.poll() is None, f"backend {i} exited (the drain test ends 0)"


async def counters(session: aiohttp.ClientSession, backend: Backend) -> dict[str, float]:
    """The backend's counters that attribute requests, each summed over its labels."""
    async with session.get(f"{backend.url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    totals = dict.fromkeys((SUCCESS, HITS, QUERIES), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


async def snapshot(
    session: aiohttp.ClientSession, backends: list[Backend]
) -> list[dict[str, float]]:
    return [await counters(session, backend) for backend in backends]


async def settled(
    session: aiohttp.ClientSession,
    backends: list[Backend],
    before: list[dict[str, float]],
    finished: int,
) -> list[dict[str, float]]:
    """The counters once `finished` more requests show as successes, summed over the backends
    (a request's counters may land just after its answer)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        after = await snapshot(session, backends)
        done = sum(a[SUCCESS] - b[SUCCESS] for a, b in zip(after, before, strict=True))
        if done >= finished or time.monotonic() > deadline:
            assert done == finished, (done, finished)
            return after
        await asyncio.sleep(0.05)


def served_by(before: list[dict[str, float]], after: list[dict[str, float]]) -> int:
    """The one backend whose success counter grew."""
    pairs = enumerate(zip(before, after, strict=True))
    grew = [i for i, (b, a) in pairs if a[SUCCESS] > b[SUCCESS]]
    assert len(grew) == 1, (before, after)
    return grew[0]


def error_lines(lines: list[str]) -> list[str]:
    """Lines logged at ERROR or above, and tracebacks."""
    return [
        line for line in lines if re.match(r"\S+ +(ERROR|CRITICAL) ", line) or "Traceback" in line
    ]


# --------------------------------------------------------------------------- routers


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 6000) -> str:
        text = self.log.read_text(errors="replace")
        return re.sub(r"\x1b\[[0-9;]*m", "", text)[-chars:]

    def workers(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/workers", timeout=10) as response:
            return orjson.loads(response.read())["workers"]

    def wait_healthy(self, urls: list[str], timeout: float = ROUTER_TIMEOUT) -> None:
        """Until the router lists every one of `urls` as healthy."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "the router exited:\n" + self.log_tail()
            try:
                healthy = {w["url"] for w in self.workers() if w.get("is_healthy")}
                if healthy >= set(urls):
                    return
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, "workers not healthy in time:\n" + self.log_tail()
            time.sleep(0.2)

    def stop(self) -> None:
        """The router's whole process group: SIGTERM, SIGKILL if it lingers."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)


def start_router(module: str, flags: list[str], backends: list[Backend], log: Path) -> Router:
    """`python -m module` (the wheel's console script runs the same main) on 127.0.0.1, its
    Prometheus listener too, each on a free port; its own process group."""
    port = free_port()
    args = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *(b.url for b in backends),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-timeout-secs", str(int(ROUTER_TIMEOUT)),
            "--worker-startup-check-interval", "1", *flags]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(proc, port, log)
    try:
        router.wait_healthy([b.url for b in backends])
    except BaseException:
        router.stop()
        raise
    return router


# --------------------------------------------------------------------------- sglang-router


@pytest.fixture(scope="class")
def sglang_router(
    backends: list[Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Router]:
    assert_running(backends)
    log = tmp_path_factory.mktemp("sglang-router") / "router.log"
    router = start_router("sglang_router.launch_router", ["--policy", "cache_aware"], backends, log)
    try:
        yield router
    finally:
        router.stop()


def probe_lines(backend: Backend) -> list[str]:
    return [line for line in backend.process.lines if GRPC_PROBE in line]


def wait_for_probe_lines(backends: list[Backend], timeout: float = 30.0) -> None:
    """The router probes gRPC on the HTTP port as it registers a worker; the lines reach us
    through each server's log reader."""
    deadline = time.monotonic() + timeout
    while not all(probe_lines(b) for b in backends) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.routers
@needs_sglang_router
class TestSglangRouter:
    async def test_requests_sharing_a_prefix_land_on_one_backend_and_hit_its_cache(
        self, backends: list[Backend], sglang_router: Router
    ):
        """cache_aware sends requests whose text shares a long prefix to the backend that
        served the first of them, where the prefix is in the KV cache."""
        assert_running(backends)
        # 158 tokens of the tiny tokenizer with the question: nine full 16-token blocks, well
        # inside the model's 256 positions with the answer.
        prefix = "Shared system prompt: " + " ".join(f"rule{i}" for i in range(20)) + "."
        count = 6
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
            before = await snapshot(session, backends)
            for i in range(count):
                body = {"model": MODEL, "prompt": f"{prefix} Question {i}?", "max_tokens": 4}
                async with session.post(
                    f"{sglang_router.url}/v1/completions", json=body
                ) as response:
                    text = await response.text()
                    assert response.status == 200, text
                assert orjson.loads(text)["choices"][0]["text"] is not None
            after = await settled(session, backends, before, count)
        served = [a[SUCCESS] - b[SUCCESS] for a, b in zip(after, before, strict=True)]
        assert sorted(served) == [0, count], served
        chosen = served.index(count)
        hits = after[chosen][HITS] - before[chosen][HITS]
        queries = after[chosen][QUERIES] - before[chosen][QUERIES]
        # All but the first find the prefix cached: (count - 1) / count of the prompt tokens,
        # less the partial blocks.
        assert queries > 0 and hits / queries > 0.5, (hits, queries, sglang_router.log_tail())

    def test_registration_leaves_no_error_in_the_backends_logs(
        self, backends: list[Backend], sglang_router: Router
    ):
        """The router registers both backends (under the served model name, read from
        /server_info), probing gRPC on the HTTP port: one INFO line per probe, no ERROR, no
        traceback."""
        workers = {w["url"]: w for w in sglang_router.workers()}
        for backend in backends:
            assert workers[backend.url]["model_id"] == MODEL, workers
        wait_for_probe_lines(backends)
        for i, backend in enumerate(backends):
            lines = backend.process.lines
            assert probe_lines(backend), f"backend {i}: no gRPC probe logged:\n" + "\n".join(lines)
            for line in probe_lines(backend):
                assert re.match(r"\S+ INFO ", line), line
            assert not error_lines(lines), f"backend {i}:\n" + "\n".join(lines)

    def test_the_grpc_probe_line_names_the_client_once(
        self, backends: list[Backend], sglang_router: Router
    ):
        """Each probe's line names the router's address once and says what the server speaks."""
        wait_for_probe_lines(backends)
        expected = (
            r"\S+ INFO +127\.0\.0\.1 opened an HTTP/2 \(gRPC\) connection; "
            r"this server speaks HTTP/1\.1 \(400\)"
        )
        lines = [line for backend in backends for line in probe_lines(backend)]
        assert lines and all(re.fullmatch(expected, line) for line in lines), lines


# --------------------------------------------------------------------------- vllm-router


@pytest.fixture(scope="class")
def vllm_router(
    backends: list[Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Router]:
    """consistent_hash on the X-Session-ID header; a health check every second that drops a
    backend at its first 503, well inside the backends' shutdown notice."""
    assert_running(backends)
    log = tmp_path_factory.mktemp("vllm-router") / "router.log"
    flags = ["--policy", "consistent_hash",
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1"]  # fmt: skip
    router = start_router("vllm_router.launch_router", flags, backends, log)
    try:
        yield router
    finally:
        router.stop()


def completion(session_id: str, stream: bool = False, max_tokens: int = 2) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"Hello from {session_id}", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}  # fmt: skip


def check_answer(status: int, raw: bytes, stream: bool, max_tokens: int) -> None:
    """A complete, successful answer: all `max_tokens` tokens, finish_reason "length"."""
    assert status == 200, raw[-2000:]
    if not stream:
        answer = orjson.loads(raw)
        assert answer["choices"][0]["finish_reason"] == "length", answer
        assert answer["usage"]["completion_tokens"] == max_tokens, answer
        return
    events = [e for e in raw.split(b"\n\n") if e.strip() and not e.startswith(b":")]
    assert events and events[-1].strip() == b"data: [DONE]", raw[-2000:]
    chunks = [orjson.loads(e.strip().removeprefix(b"data: ")) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert reasons and reasons[-1] == "length", chunks


@pytest.mark.routers
@needs_vllm_router
class TestVllmRouter:
    async def test_sessions_spread_over_both_backends_and_each_stays_on_one(
        self, backends: list[Backend], vllm_router: Router
    ):
        """consistent_hash pins each X-Session-ID to one backend; distinct sessions reach
        both. Each request is told apart by the one backend whose success counter grew."""
        assert_running(backends)
        home: dict[str, int] = {}
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:

            async def send(session_id: str) -> int:
                before = await snapshot(session, backends)
                async with session.post(
                    f"{vllm_router.url}/v1/completions",
                    json=completion(session_id),
                    headers={"X-Session-ID": session_id},
                ) as response:
                    check_answer(response.status, await response.read(), False, 2)
                return served_by(before, await settled(session, backends, before, 1))

            # New sessions until both backends have some (the ring depends on the ports, so
            # the count varies; 40 fail only if one backend owned nearly all of the ring).
            for n in range(40):
                session_id = f"session-{n}"
                home[session_id] = await send(session_id)
                if n >= 7 and len(set(home.values())) == 2:
                    break
            assert set(home.values()) == {0, 1}, (home, vllm_router.log_tail())
            for _ in range(2):  # each session comes back to its backend
                for session_id, backend in home.items():
                    assert await send(session_id) == backend, session_id

    async def test_a_backend_terminated_with_a_notice_costs_no_request(
        self, backends: list[Backend], vllm_router: Router
    ):
        """A steady stream through the router (streamed and not) while backend 0 gets SIGTERM
        with --shutdown-notice: its /health turns 503 at once, the router drops it within the
        notice, every request succeeds, and the backend drains and exits 0."""
        assert_running(backends)
        vllm_router.wait_healthy([b.url for b in backends])
        url = f"{vllm_router.url}/v1/completions"
        max_tokens = 8
        results: list[tuple[float, bool, int, bytes]] = []
        stop = asyncio.Event()

        async def client(session: aiohttp.ClientSession, j: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                session_id, stream = f"drain-{j}-{n % 16}", n % 2 == 0
                started = time.monotonic()
                async with session.post(
                    url,
                    json=completion(session_id, stream, max_tokens),
                    headers={"X-Session-ID": session_id},
                ) as response:
                    results.append((started, stream, response.status, await response.read()))

        target = backends[0]
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
            before = await counters(session, target)
            clients = [asyncio.create_task(client(session, j)) for j in range(3)]
            try:
                # Backend 0 is in the rotation: it served some of the stream.
                deadline = time.monotonic() + 60
                while (await counters(session, target))[SUCCESS] < before[SUCCESS] + 3:
                    assert time.monotonic() < deadline and not any(c.done() for c in clients)
                    await asyncio.sleep(0.1)
                target.process.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                dropped = None
                while target.process.proc.poll() is None:
                    if dropped is None:
                        workers = await asyncio.to_thread(vllm_router.workers)
                        if not any(w["url"] == target.url and w["is_healthy"] for w in workers):
                            dropped = time.monotonic() - signalled
                    assert time.monotonic() - signalled < NOTICE + 60, "backend 0 did not exit"
                    await asyncio.sleep(0.2)
                exited = time.monotonic() - signalled
                code, _ = await asyncio.to_thread(target.process.wait_exit, 30)
                count_at_exit = len(results)
                await asyncio.sleep(1.0)  # the stream goes on, on backend 1 alone
            finally:
                stop.set()
                done = await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 120)
        for outcome in done:
            assert outcome is None, repr(outcome)
        for _, stream, status, raw in results:
            check_answer(status, raw, stream, max_tokens)
        after_signal = [r for r in results if r[0] >= signalled]
        assert len(after_signal) >= 5 and len(results) > count_at_exit, len(results)
        assert dropped is not None and dropped < NOTICE, (dropped, vllm_router.log_tail())
        assert code == 0 and NOTICE <= exited < NOTICE + 30, (code, exited)
        log = target.process.output
        assert f"Shutting down in {NOTICE} s (--shutdown-notice)" in log, log
        assert "Shutting down: draining" in log, log
        assert not error_lines(target.process.lines), log
