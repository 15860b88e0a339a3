"""The server's event loop: asyncio's by default, uvloop's only when asked for, a bad choice
refused by name."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from aioinfer.engine.event_loop import EVENT_LOOP_ENV, loop_factory


def test_the_default_loop_is_asyncio_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert loop_factory() is asyncio.new_event_loop
    monkeypatch.setenv(EVENT_LOOP_ENV, "auto")
    assert loop_factory() is asyncio.new_event_loop


def test_uvloop_only_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("uvloop") is None:
        pytest.skip("uvloop is not installed")
    import uvloop

    monkeypatch.setenv(EVENT_LOOP_ENV, "uvloop")
    assert loop_factory() is uvloop.new_event_loop


def test_uvloop_asked_for_but_not_installed_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "uvloop")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"aioinfer\[uvloop\]"):
        loop_factory()


def test_an_unknown_loop_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match=EVENT_LOOP_ENV):
        loop_factory()
