"""Start-up: `aioinfer --help` stays free of heavy imports, and `aioinfer bench startup` times
real server processes (ours on a tiny model, and a stand-in peer) from spawn to /health and to a
first completion."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aioinfer.bench.startup import (
    PHASE_PATTERNS,
    StartupRun,
    StartupSummary,
    free_port,
    main,
    measure_start,
    parse_phases,
    peer_command,
    server_label,
)
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

HEAVY_MODULES = ("torch", "transformers", "tokenizers", "aiohttp", "gguf", "safetensors", "numpy")
REPO = Path(__file__).resolve().parents[2]

# A stand-in server: listens after a delay, answers /health 503 for a while, then serves a
# 1-token completion; it logs phase lines in our wording.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    time.sleep(0.3)
    first_health = None  # the 503 window runs from the first /health it answers
    print("Loading weights took 0.12 seconds", flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            global first_health
            if self.path == "/health":
                first_health = first_health or time.monotonic()
                ready = time.monotonic() - first_health > 0.4
                if ready:
                    print("Ready in 0.55 s", flush=True)
                self.reply(200 if ready else 503, {})
            else:
                self.reply(200, {"data": [{"id": "fake"}]})

        def do_POST(self):
            length = int(self.headers["Content-Length"])
            body = json.loads(self.rfile.read(length))
            assert body["model"] == "fake" and body["max_tokens"] == 1
            self.reply(200, {"choices": [{"text": "x"}]})

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def _imports_of_cli(*args: str) -> list[str]:
    """The heavy top-level packages a fresh interpreter holds after `aioinfer ARGS`."""
    code = textwrap.dedent(
        f"""
        import json, runpy, sys
        sys.argv = ["aioinfer", *{list(args)!r}]
        try:
            runpy.run_module("aioinfer", run_name="__main__")
        except SystemExit:
            pass
        heavy = {HEAVY_MODULES!r}
        loaded = {{m.split(".")[0] for m in sys.modules}}
        print(json.dumps(sorted(loaded & set(heavy))), file=sys.stderr)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [("--help",), ("serve", "--help"), ("serve", "--help=all")])
def test_help_imports_nothing_heavy(args: tuple[str, ...]) -> None:
    assert _imports_of_cli(*args) == []


def test_parse_phases_reads_the_startup_log() -> None:
    log = "\n".join(
        [
            "19:24:14 INFO     Imports took 1.20 seconds",
            "19:24:15 INFO     converted SmolLM2-135M-Instruct.Q4_1.gguf in 8.9 s",
            "         INFO     Resolving the model took 2.50 seconds",
            "         INFO     Loading the tokenizer took 0.30 seconds",
            "         INFO     Loading weights took 0.67 seconds",
            "         INFO     Memory profiling took 0.40 seconds",
            "         INFO     Allocating the KV cache took 0.01 seconds",
            "         INFO     Graph capturing finished in 3 secs, took 0.10 GiB",
            "         INFO     init engine (profile, create kv cache, warmup model) took 3.83 "
            "seconds",
            "         INFO     Ready in 6.02 s",
        ]
    )
    assert parse_phases(log) == {
        "import": 1.2,
        "convert": 8.9,
        "resolve": 2.5,
        "tokenizer": 0.3,
        "weights": 0.67,
        "profiling": 0.4,
        "kv cache": 0.01,
        "graphs": 3.0,
        "init engine": 3.83,
        "ready": 6.02,
    }
    assert list(parse_phases(log)) == list(PHASE_PATTERNS)
    assert parse_phases("nothing here") == {}


def test_commands_and_labels() -> None:
    assert peer_command("vllm serve m --port {port}", 81) == ["vllm", "serve", "m", "--port", "81"]
    assert peer_command("llama-server -m 'a b.gguf'", 82)[-4:] == [
        "--host",
        "127.0.0.1",
        "--port",
        "82",
    ]
    assert peer_command("llama-server -m 'a b.gguf'", 82)[2] == "a b.gguf"
    assert server_label(["/usr/bin/vllm", "serve"]) == "vllm"
    assert server_label([sys.executable, "-m", "aioinfer", "serve"]) == "aioinfer"


def test_medians_skip_failed_runs() -> None:
    summary = StartupSummary("x", ["x"])
    summary.runs = [
        StartupRun("x", health_s=1.0, first_request_s=2.0, phases={"ready": 0.9}),
        StartupRun("x", health_s=3.0, error="boom"),
        StartupRun("x", health_s=2.0, first_request_s=4.0, phases={"ready": 1.9}),
    ]
    assert summary.median("health_s") == 2.0
    assert summary.median("first_request_s") == 3.0
    assert summary.median_phase("ready") == pytest.approx(1.4)
    assert summary.median_phase("weights") is None


def test_measure_start_times_a_server_from_spawn(tmp_path: Path) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()

    run = measure_start([sys.executable, str(script), "--port", str(port)], port, timeout=60)

    assert run.error is None
    assert run.listen_s is not None and run.health_s is not None
    assert run.first_request_s is not None
    assert 0.3 <= run.listen_s < run.health_s <= run.first_request_s < 30
    # The server answers 503 for 0.4 s from the first /health; the slack is the first reply's trip.
    assert run.health_s - run.listen_s >= 0.2
    assert run.phases == {"weights": 0.12, "ready": 0.55}


def test_measure_start_reports_a_server_that_dies(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('no model here', flush=True)\nsys.exit(3)\n")
    port = free_port()

    run = measure_start([sys.executable, str(script)], port, timeout=60)

    assert run.listen_s is None and run.health_s is None and run.first_request_s is None
    assert run.error is not None and "code 3" in run.error and "no model here" in run.error


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-startup")
    make_variant("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def test_bench_startup_measures_ours_and_a_peer(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    result_file = tmp_path / "startup.json"
    monkeypatch.chdir(REPO)  # the server subprocess runs `python -m aioinfer` from here

    summaries = main(
        [str(tiny_model_dir), "--kv-cache-memory", "0.01", "--max-model-len", "128"],
        runs=1,
        vs=f"{sys.executable} {script} --port {{port}}",
        vs_name="fake",
        result_file=str(result_file),
    )

    ours, peer = summaries
    assert [r.error for r in ours.runs + peer.runs] == [None, None]
    run = ours.runs[0]
    assert run.listen_s is not None and run.health_s is not None
    assert run.first_request_s is not None
    assert run.listen_s <= run.health_s <= run.first_request_s
    assert {"weights", "init engine", "ready"} <= set(run.phases)
    assert run.phases["ready"] <= run.health_s  # the log's clock starts after the spawn
    assert peer.server == "fake" and peer.runs[0].phases == {"weights": 0.12, "ready": 0.55}
    saved = json.loads(result_file.read_text())
    assert [s["server"] for s in saved["servers"]] == ["aioinfer", "fake"]
    assert saved["servers"][0]["median_health_s"] == pytest.approx(run.health_s)
