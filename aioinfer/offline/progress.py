"""The offline LLM's progress bar: prompts done, and tokens per second."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine


class Progress:
    """A rich progress bar with output tokens per second (input tokens for embeddings, which
    output none: `counter` "prompt", counted from `start_tokens` when given). `use_tqdm`: a
    callable given as vLLM's `use_tqdm` (say functools.partial(tqdm, leave=False)) makes the
    bar instead, as vLLM calls it."""

    def __init__(
        self,
        total: int,
        engine: AsyncEngine,
        counter: str = "generation",
        start_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> None:
        self.engine = engine
        self.counter = counter
        self.label = "output" if counter == "generation" else "input"
        self.start_tokens = self._tokens() if start_tokens is None else start_tokens
        self.start = time.perf_counter()
        if callable(use_tqdm):
            self.tqdm = use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.tqdm = None
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
        speed = f"{rate:.1f} {self.label} tok/s"
        if self.tqdm is not None:
            self.tqdm.postfix = speed  # shown by the update's refresh
            self.tqdm.update(1)
            return
        self.bar.update(self.task, advance=1, speed=speed)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
            return
        self.bar.stop()
