"""A /health poller on a thread of its own: how long the server's event loop kept a bystander
waiting while something else ran."""

from __future__ import annotations

import http.client
import threading
import time
from types import TracebackType
from urllib.parse import urlsplit


class HealthPoller:
    """GET /health on a fresh connection every `interval` seconds until the block ends;
    `worst` is the longest any of them waited (connect to last byte), `answers` the statuses."""

    def __init__(self, url: str, interval: float = 0.05) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.interval = interval
        self.waits: list[float] = []
        self.answers: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @property
    def worst(self) -> float:
        return max(self.waits, default=0.0)

    def _poll(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                self.answers.append(response.status)
            finally:
                conn.close()
            self.waits.append(time.monotonic() - start)
            self._stop.wait(self.interval)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(70)
