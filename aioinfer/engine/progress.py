"""The offline LLM's progress bar: prompts done, and tokens per second."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


class Progress:
    """A rich progress bar with output tokens per second (input tokens for embeddings, which
    output none: `counter` "prompt", counted from `start_tokens` when given)."""

    def __init__(
        self,
        total: int,
        engine: AsyncEngine,
        counter: str = "generation",
        start_tokens: int | None = None,
    ) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.engine = engine
        self.counter = counter
        self.label = "output" if counter == "generation" else "input"
        self.start_tokens = self._tokens() if start_tokens is None else start_tokens
        self.start = time.perf_counter()
        self.bar = Progress(
            TextColumn("Processed prompts"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[speed]}"),
            transient=False,
        )
        self.task = self.bar.add_task("generate", total=total, speed="")
        self.bar.start()

    def _tokens(self) -> int:
        return int(getattr(self.engine.stats, f"{self.counter}_tokens"))

    def advance(self) -> None:
        tokens = self._tokens() - self.start_tokens
        rate = tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(self.task, advance=1, speed=f"{rate:.1f} {self.label} tok/s")

    def close(self) -> None:
        self.bar.stop()
