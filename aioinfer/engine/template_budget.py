"""Rendering a chat template that a request brought (--trust-request-chat-template), under a
budget.

Jinja's sandbox stops such a template from reaching code or files, not from working: nested
loops run for ever, and `'x' * 10**9`, `'{:1000000}' * 1000` formatted or a join of a range
allocate gigabytes inside single C calls, which no check between two lines of Python can stop.
transformers also keeps compiled templates cached (and Jinja folds constants such as
`'x' * N` into the compiled code). So a request's template renders in a child process of its
own (`TemplateRenderer`), started on first use:

- its memory is capped (RLIMIT_DATA, MEMORY_BUDGET bytes above what it holds at rest): an
  allocation past it fails with MemoryError, the rendering is refused and the child exits;
- each rendering has `cpu_seconds` of CPU time (a profiling timer in the child); the parent
  kills the child past a wall-clock deadline (a C call that never returns) or as soon as
  `cancelled` is set (the request's client left);
- each template is compiled for one rendering and then dropped (the child clears
  transformers' caches and collects the compiled template after each);
- a rendering longer than `max_chars` is refused.

A child that exited or was killed is replaced on the next rendering (1-2 s to start). The
render is transformers' own (`render_jinja_template`, as `apply_chat_template` calls it with
the tokenizer's special tokens), so a request's template sees what the model's would.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import jinja2
import orjson

# What a child may allocate on top of what it holds at rest (about 120 MB with transformers).
MEMORY_BUDGET = 256 * 1024 * 1024
# A child that does not answer within this many times its CPU budget (plus a margin for a busy
# machine) is killed: a C call that runs on and on.
WALL_FACTOR = 5
WALL_MARGIN = 5.0
START_TIMEOUT = 120.0  # seconds for a child to import what it renders with
_POLL = 0.05  # seconds between looks at `cancelled` while a rendering runs
MAX_ERROR_CHARS = 1000  # of a template's error message, as the child reports it


class TemplateBudgetError(jinja2.exceptions.TemplateError):
    """A request's template went past its budget (memory, CPU time, output), or its client
    left while it rendered."""


class TemplateRenderer:
    """The child process that renders request templates, one at a time (a lock); see the
    module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: Connection | None = None
        self._writer: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The running child's process id, if one runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def render(
        self,
        template: str,
        messages: list[dict[str, Any]],
        options: dict[str, Any],
        variables: dict[str, Any],
        max_chars: int,
        cpu_seconds: float,
        cancelled: threading.Event | None = None,
    ) -> str:
        """`template` rendered for `messages`, with `options` (add_generation_prompt,
        continue_final_message, tools, documents) and `variables` (the tokenizer's special
        tokens, chat_template_kwargs). Raises TemplateBudgetError past the budget,
        jinja2.TemplateError for a template that fails."""
        cancelled = cancelled or threading.Event()
        job = {
            "template": template,
            "messages": messages,
            "options": options,
            "variables": variables,
            "max_chars": max_chars,
            "cpu_seconds": cpu_seconds,
        }
        with self._lock:
            reader, writer = self._started(cancelled)
            try:
                writer.send_bytes(orjson.dumps(job))
            except OSError:
                self._stop()
                raise TemplateBudgetError("the chat template's renderer stopped") from None
            deadline = time.monotonic() + WALL_FACTOR * cpu_seconds + WALL_MARGIN
            reply = self._wait(reader, deadline, cancelled, f"{cpu_seconds:g} s of CPU time")
        if "text" in reply:
            return str(reply["text"])
        if "budget" in reply:
            raise TemplateBudgetError(reply["budget"])
        raise jinja2.TemplateError(reply["error"])

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _started(self, cancelled: threading.Event) -> tuple[Connection, Connection]:
        if self._proc is not None and self._proc.poll() is None:
            assert self._reader is not None and self._writer is not None
            return self._reader, self._writer
        self._stop()
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        root = Path(__file__).resolve().parents[2]  # where `aioinfer` is imported from
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(child_read), str(child_write)],
                pass_fds=(child_read, child_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                cwd=root,
            )
        finally:
            os.close(child_read)
            os.close(child_write)
        self._reader = Connection(parent_read, writable=False)
        self._writer = Connection(parent_write, readable=False)
        ready = self._wait(self._reader, time.monotonic() + START_TIMEOUT, cancelled, "")
        if ready != {"ready": True}:
            self._stop()
            raise RuntimeError(f"the chat template renderer did not start: {ready}")
        return self._reader, self._writer

    def _wait(
        self, reader: Connection, deadline: float, cancelled: threading.Event, budget: str
    ) -> dict[str, Any]:
        """The child's next reply; the child is killed when it is too late or cancelled."""
        while not reader.poll(_POLL):
            if cancelled.is_set():
                self._stop()
                raise TemplateBudgetError(
                    "the request's chat template was stopped: its client left"
                )
            if time.monotonic() > deadline:
                self._stop()
                raise TemplateBudgetError(
                    f"the request's chat template ran past its budget of {budget or 'time'}"
                )
        try:
            reply: dict[str, Any] = orjson.loads(reader.recv_bytes())
        except (EOFError, OSError, orjson.JSONDecodeError):
            self._stop()
            raise TemplateBudgetError(
                "the chat template's renderer stopped while rendering (past its budget of "
                f"{MEMORY_BUDGET >> 20} MiB of memory?)"
            ) from None
        if reply.get("exit"):
            self._stop()
        return reply

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        for conn in (self._reader, self._writer):
            if conn is not None:
                conn.close()
        self._reader = self._writer = None


RENDERER = TemplateRenderer()


# ------------------------------------------------------------------------------ the child


class _OutOfTime(BaseException):
    """Raised by the CPU timer's signal; a BaseException, so that no `except Exception` in a
    library swallows it."""


def _on_timer(signum: int, frame: Any) -> None:
    raise _OutOfTime


def _limit_memory(budget: int) -> None:
    """Cap the data this process may hold at what it holds now plus `budget` bytes."""
    import resource

    status = Path("/proc/self/status")
    if not status.exists():
        return  # not Linux: no cap (the CPU budget and the output cap still hold)
    at_rest = next(
        int(line.split()[1]) * 1024
        for line in status.read_text().splitlines()
        if line.startswith("VmData:")
    )
    resource.setrlimit(resource.RLIMIT_DATA, (at_rest + budget, at_rest + budget))


def _render(job: dict[str, Any]) -> dict[str, Any]:
    from transformers.utils import chat_template_utils

    options = job["options"]
    cpu_seconds = job["cpu_seconds"]
    # As apply_chat_template hands messages over: keys whose value is None left out.
    messages = [{k: v for k, v in m.items() if v is not None} for m in job["messages"]]
    try:
        signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
        try:
            # (rendered chats, generation indices), whatever its annotation says
            result: Any = chat_template_utils.render_jinja_template(
                conversations=[messages],
                tools=options["tools"],
                documents=options["documents"],
                chat_template=job["template"],
                continue_final_message=options["continue_final_message"],
                add_generation_prompt=options["add_generation_prompt"],
                **job["variables"],
            )
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        text = result[0][0]
    except _OutOfTime:
        return {"budget": f"the request's chat template ran past its budget of {cpu_seconds:g} s "
                "of CPU time"}  # fmt: skip
    except MemoryError:
        return {
            "budget": "the request's chat template ran past its budget of "
            f"{MEMORY_BUDGET >> 20} MiB of memory",
            "exit": True,
        }
    except Exception as exc:  # whatever the template raised: its own failure
        return {"error": str(exc)[:MAX_ERROR_CHARS] or type(exc).__name__}
    finally:
        for cached in (
            "_compile_jinja_template",
            "_get_template_variables",
            "_get_template_literal_text",
        ):
            cache_clear = getattr(getattr(chat_template_utils, cached, None), "cache_clear", None)
            if cache_clear is not None:
                cache_clear()
        gc.collect()  # a compiled template and its environment refer to each other
    if len(text) > job["max_chars"]:
        return {
            "budget": f"the request's chat template wrote {len(text)} characters, past its "
            f"budget of {job['max_chars']}"
        }
    return {"text": text}


def main(argv: list[str]) -> None:
    """The child: renders each job it reads until its parent closes the pipe."""
    reader = Connection(int(argv[1]), writable=False)
    writer = Connection(int(argv[2]), readable=False)
    from transformers.utils import chat_template_utils  # noqa: F401  (imported at rest)

    signal.signal(signal.SIGPROF, _on_timer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the server's to handle; EOF ends us
    _limit_memory(MEMORY_BUDGET)
    writer.send_bytes(orjson.dumps({"ready": True}))
    while True:
        try:
            job = orjson.loads(reader.recv_bytes())
        except EOFError:
            return
        reply = _render(job)
        try:
            answer = orjson.dumps(reply)
        except orjson.JSONEncodeError:  # a lone surrogate from an escape in the template
            answer = orjson.dumps({"error": "the chat template wrote text that is not Unicode"})
        writer.send_bytes(answer)
        if reply.get("exit"):
            return


if __name__ == "__main__":
    main(sys.argv)
