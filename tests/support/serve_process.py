"""`aioinfer serve` as a real subprocess, for the tests that need the whole program."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

READY_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_model_dir(path: Path, max_position_embeddings: int = 256) -> Path:
    from tests.support.tiny_models import make_hf_model
    from tests.support.tokenizers import make_tokenizer

    make_hf_model("llama", max_position_embeddings=max_position_embeddings).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


class ServeProcess:
    """`aioinfer serve` in a subprocess; its output is collected by a reader thread."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aioinfer", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "Ready in" in line:
                self._ready.set()
        self._ready.set()  # the process ended: whoever waits must look

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        self._ready.wait(timeout)
        if not any("Ready in" in line for line in self.lines):
            self.kill()
            raise AssertionError("server did not become ready:\n" + self.output)

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        """(exit code, seconds it took)."""
        start = time.monotonic()
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (killed if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait_exit(timeout)[0]
        finally:
            self.kill()


def rss_bytes(pid: int) -> int:
    """The resident memory of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
