"""The event loop the server runs on: asyncio's own by default; AIOINFER_EVENT_LOOP=uvloop picks
uvloop's (`pip install 'aioinfer[uvloop]'`). uvloop is opt-in because, serving SmolLM2 on the
2-core CPU machine, its loop thread ran at 100 % of a core while idle in epoll (a spin in C,
never in Python), and the compute threads' barriers then waited on it: 18-34 output tok/s
against 205 on asyncio's loop, same build, same run (docs/benchmarks-log.md). (The offline LLM
keeps asyncio's in any case: a Ctrl-C raised in the caller's thread must stop its batch at once,
and uvloop's loop, waiting in C, does not see one raised by `_thread.interrupt_main`.)"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")
EVENT_LOOP_ENV = "AIOINFER_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    choice = os.environ.get(EVENT_LOOP_ENV, "auto")
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV} must be auto, asyncio or uvloop, got {choice!r}")
    if choice != "uvloop":
        return asyncio.new_event_loop
    if importlib.util.find_spec("uvloop") is None:
        raise ValueError(
            f"{EVENT_LOOP_ENV}=uvloop needs uvloop, which is not installed "
            "(pip install 'aioinfer[uvloop]')"
        )
    import uvloop

    return uvloop.new_event_loop


def run_on_event_loop(
    main: Coroutine[Any, Any, _T], new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> _T:
    """asyncio.run(main) on a loop from `new_loop` (what `loop_factory` chose)."""
    if sys.version_info < (3, 11):  # no Runner: asyncio's loop
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)
