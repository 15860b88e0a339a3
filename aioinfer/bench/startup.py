"""`aioinfer bench startup`: how long a server takes to become useful, measured from outside.

Each run spawns the server on a free loopback port and times, from just before the spawn:

    listen   the first answer of any status from GET /health (polled every POLL_SECONDS)
    health   the first 200 from GET /health
    first    the first completed request: GET /v1/models for the name, then a 1-token completion

The server's startup log gives the phases beside them (`weights`, `init engine`, `ready`, and
`convert` when a GGUF was converted into the cache). A `--vs` command (vllm, llama-server, ...) is
measured the same way in the same run, its runs alternating with ours so both see the same
machine load; its log is parsed with the same patterns, which follow vLLM's wording.

Only the standard library talks to the servers, so the measurement adds little load of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

POLL_SECONDS = 0.02
STOP_SECONDS = 30.0
HOST = "127.0.0.1"
# Phase name -> the startup log line that gives its seconds, in start-up order. Lines a server
# does not print leave their column out of the table.
PHASE_PATTERNS = {
    "import": re.compile(r"Imports took ([\d.]+) seconds"),
    "convert": re.compile(r"converted \S+ in ([\d.]+) s"),
    "resolve": re.compile(r"Resolving the model took ([\d.]+) seconds"),
    "tokenizer": re.compile(r"Loading the tokenizer took ([\d.]+) seconds"),
    "weights": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "profiling": re.compile(r"Memory profiling took ([\d.]+) seconds"),
    "kv cache": re.compile(r"Allocating the KV cache took ([\d.]+) seconds"),
    "graphs": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init engine": re.compile(r"init engine .*? took ([\d.]+) seconds"),
    "ready": re.compile(r"Ready in ([\d.]+) s"),
}
_LOG_TAIL_LINES = 30


@dataclass
class StartupRun:
    """One start of one server; times in seconds from just before the process was spawned."""

    server: str
    health_s: float | None = None
    first_request_s: float | None = None
    listen_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class StartupSummary:
    """All runs of one server command and their medians."""

    server: str
    command: list[str]
    runs: list[StartupRun] = field(default_factory=list)

    def median(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]
        return statistics.median(values) if values else None

    def median_phase(self, phase: str) -> float | None:
        values = [r.phases[phase] for r in self.runs if phase in r.phases]
        return statistics.median(values) if values else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "command": self.command,
            "median_listen_s": self.median("listen_s"),
            "median_health_s": self.median("health_s"),
            "median_first_request_s": self.median("first_request_s"),
            "median_phases": {p: self.median_phase(p) for p in PHASE_PATTERNS},
            "runs": [asdict(r) for r in self.runs],
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def ours_command(serve_args: list[str], port: int) -> list[str]:
    """`aioinfer serve` with the given arguments on a loopback port (ours come last and win)."""
    return [
        sys.executable, "-m", "aioinfer", "serve", *serve_args, "--host", HOST, "--port", str(port)
    ]  # fmt: skip


def peer_command(command: str, port: int) -> list[str]:
    """`command` with {port} replaced, or with --host/--port appended when it has no {port}."""
    if "{port}" in command:
        return shlex.split(command.replace("{port}", str(port)))
    return [*shlex.split(command), "--host", HOST, "--port", str(port)]


def server_label(argv: list[str]) -> str:
    """A short name for a command: its program, or the module of `python -m MODULE`."""
    program = Path(argv[0]).name
    if program.startswith("python") and "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return program


def parse_phases(log: str) -> dict[str, float]:
    """Seconds of each startup phase the log reports (the last line of each kind wins)."""
    phases: dict[str, float] = {}
    for name, pattern in PHASE_PATTERNS.items():
        matches = pattern.findall(log)
        if matches:
            phases[name] = float(matches[-1])
    return phases


def measure_start(
    argv: list[str], port: int, timeout: float, env: dict[str, str] | None = None
) -> StartupRun:
    """Start `argv` (a server listening on `port`), time it, stop it."""
    run = StartupRun(server_label(argv))
    base = f"http://{HOST}:{port}"
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # its own process group: children are stopped with it
        )
        try:
            deadline = start + timeout
            run.listen_s = _wait_healthy(proc, base, deadline) - start
            run.health_s = time.perf_counter() - start
            _first_completion(base, deadline)
            run.first_request_s = time.perf_counter() - start
        except (RuntimeError, OSError, ValueError) as exc:
            run.error = str(exc)
        finally:
            _stop(proc)
        log.seek(0)
        text = log.read()
    run.phases = parse_phases(text)
    if run.error is not None:
        tail = "\n".join(text.splitlines()[-_LOG_TAIL_LINES:])
        run.error = f"{run.error}\n{tail}"
    return run


def _wait_healthy(proc: subprocess.Popen[Any], base: str, deadline: float) -> float:
    """Poll /health until it answers 200; returns when it first answered at all."""
    answered: float | None = None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                now = time.perf_counter()
                if response.status == 200:
                    return answered if answered is not None else now
        except urllib.error.HTTPError:  # 503 while loading: listening already
            now = time.perf_counter()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            now = None  # not listening yet
        if answered is None and now is not None:
            answered = now
        if time.perf_counter() > deadline:
            raise RuntimeError("timed out waiting for /health")
        time.sleep(POLL_SECONDS)


def _first_completion(base: str, deadline: float) -> None:
    timeout = max(deadline - time.perf_counter(), 1.0)
    with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout) as response:
        models = json.load(response)
    model = models["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result = json.load(response)
    if not result.get("choices"):
        raise RuntimeError(f"the completion has no choices: {result}")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, sig)


def run_startup_bench(
    serve_args: list[str],
    runs: int = 3,
    vs: str | None = None,
    cold: bool = False,
    timeout: float = 600.0,
    vs_name: str | None = None,
) -> list[StartupSummary]:
    """`runs` starts of ours (and of `vs`, alternating); `cold` gives ours an empty cache each
    time, so a GGUF is converted on every start."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    ours = StartupSummary("aioinfer", [*ours_command(serve_args, 0)[:-1], "{port}"])
    peer = None
    if vs:
        peer = StartupSummary(vs_name or server_label(shlex.split(vs)), shlex.split(vs))
    for _ in range(runs):
        ours.runs.append(_run_ours(serve_args, cold, timeout))
        if peer is not None and vs is not None:
            port = free_port()
            peer.runs.append(measure_start(peer_command(vs, port), port, timeout))
            peer.runs[-1].server = peer.server
    return [ours] if peer is None else [ours, peer]


def _run_ours(serve_args: list[str], cold: bool, timeout: float) -> StartupRun:
    port = free_port()
    if not cold:
        return measure_start(ours_command(serve_args, port), port, timeout)
    with tempfile.TemporaryDirectory(prefix="aioinfer-cold-") as cache:
        env = {"AIOINFER_CACHE": cache}
        return measure_start(ours_command(serve_args, port), port, timeout, env)


def render_table(summaries: list[StartupSummary], title: str) -> Any:
    """Medians per server; a phase column only where some server logged that phase."""
    from rich.table import Table

    phases = [p for p in PHASE_PATTERNS if any(s.median_phase(p) is not None for s in summaries)]
    table = Table(title=title)
    for header in ("server", "ok", "listen", "health", "1st completion", *phases):
        table.add_column(header, justify="left" if header == "server" else "right")
    for summary in summaries:
        ok = sum(r.error is None for r in summary.runs)
        table.add_row(
            summary.server,
            f"{ok}/{len(summary.runs)}",
            _fmt(summary.median("listen_s")),
            _fmt(summary.median("health_s")),
            _fmt(summary.median("first_request_s")),
            *(_fmt(summary.median_phase(p)) for p in phases),
        )
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(
    serve_args: list[str],
    runs: int = 3,
    vs: str | None = None,
    cold: bool = False,
    timeout: float = 600.0,
    result_file: str | None = None,
    vs_name: str | None = None,
) -> list[StartupSummary]:
    """Run the benchmark, print the table (and failed runs' logs), write `result_file`."""
    from rich.console import Console

    console = Console()
    summaries = run_startup_bench(serve_args, runs, vs, cold, timeout, vs_name)
    for summary in summaries:
        for run in summary.runs:
            if run.error is not None:
                console.print(f"{summary.server} failed: {run.error}", markup=False, style="red")
    cache = "cold: empty cache" if cold else "warm cache"
    title = f"Start-up seconds from spawn, median of {runs} ({cache}); phases from the log"
    console.print(render_table(summaries, title))
    if result_file:
        payload = {"runs": runs, "cold": cold, "servers": [s.as_dict() for s in summaries]}
        Path(result_file).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return summaries
