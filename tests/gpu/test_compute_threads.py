"""The model runs on no more compute threads than other processes leave cores free: its start
measured while the model resolves, its serving about once a second between steps."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aioinfer.engine.runner_factory import DefaultRunnerFactory
from aioinfer.gpu import compute_threads
from aioinfer.gpu.compute_threads import (
    CpuSnapshot,
    free_cores,
    read_busy_seconds,
    threads_for,
)


def test_busy_seconds_count_the_process_s_cores_and_leave_out_idle_and_iowait(tmp_path: Path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  9999 0 9999 9999 9999 0 0 0 0 0\n"
        "cpu0 100 5 50 700 40 3 2 10 0 0\n"  # busy: 100 + 5 + 50 + 3 + 2 + 10 = 170 ticks
        "cpu1 200 0 100 500 0 0 0 0 0 0\n"  # busy: 300 ticks
        "cpu2 900 0 0 0 0 0 0 0 0 0\n"  # not this process's core
        "intr 12345 1 2 3\n"
    )
    ticks = os.sysconf("SC_CLK_TCK")
    assert read_busy_seconds({0, 1}, str(stat)) == pytest.approx(470 / ticks)
    assert read_busy_seconds({1}, str(stat)) == pytest.approx(300 / ticks)
    assert read_busy_seconds({0}, str(tmp_path / "missing")) is None


def snap(busy: float, own: float, wall: float, cores: int = 2) -> CpuSnapshot:
    return CpuSnapshot(busy=busy, own=own, wall=wall, cores=cores)


def test_free_cores_subtract_others_work_not_this_process_s():
    # One second: the cores were busy 1.6 s, 0.6 s of it this process's own.
    assert free_cores(snap(10.0, 3.0, 100.0), snap(11.6, 3.6, 101.0)) == pytest.approx(1.0)
    # Only this process worked: every core counts as free.
    assert free_cores(snap(10.0, 3.0, 100.0), snap(11.9, 4.9, 101.0)) == pytest.approx(2.0)
    # Counters of different resolutions may put own above busy: never more than every core.
    assert free_cores(snap(10.0, 3.0, 100.0), snap(10.5, 3.7, 101.0)) == pytest.approx(2.0)
    assert free_cores(snap(10.0, 3.0, 100.0), snap(10.1, 3.0, 100.01)) is None  # too short


@pytest.mark.parametrize(
    ("configured", "free", "threads"),
    [(2, None, 2), (2, 2.0, 2), (2, 1.6, 2), (2, 1.0, 1), (2, 0.1, 1), (8, 5.2, 5), (1, 0.0, 1)],
)
def test_threads_for_a_start(configured, free, threads):
    assert threads_for(configured, free) == threads


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def busy_machine(monkeypatch: pytest.MonkeyPatch, others: float) -> CpuSnapshot:
    """`snapshot()` answers as if other processes kept `others` of 2 cores busy for 1 s."""
    before = snap(50.0, 1.0, 10.0)
    after = snap(50.0 + others + 0.5, 1.5, 11.0)  # plus this process's own 0.5 s
    monkeypatch.setattr(compute_threads, "snapshot", lambda: after)
    return before


def test_a_busy_core_starts_the_model_on_one_thread_and_serving_gets_both_back(
    two_threads, monkeypatch, caplog
):
    before = busy_machine(monkeypatch, others=1.0)
    with caplog.at_level(logging.INFO, logger="aioinfer"), compute_threads.start_threads(before):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    [line] = [r.getMessage() for r in caplog.records if "cores busy" in r.getMessage()]
    assert "1.0 of 2 cores busy" in line and "starts with 1 compute thread" in line


def test_quiet_cores_keep_every_thread(two_threads, monkeypatch):
    before = busy_machine(monkeypatch, others=0.1)
    with compute_threads.start_threads(before):
        assert torch.get_num_threads() == 2


def test_the_count_comes_back_when_the_start_fails(two_threads, monkeypatch):
    before = busy_machine(monkeypatch, others=1.0)
    with pytest.raises(RuntimeError), compute_threads.start_threads(before):
        raise RuntimeError("the weights did not load")
    assert torch.get_num_threads() == 2


def test_the_runner_is_built_with_the_threads_measured_while_the_model_resolved(
    two_threads, monkeypatch
):
    import aioinfer.gpu.runner as runner_module

    seen: list[int] = []
    calls: list[str] = []

    class Runner:
        @staticmethod
        def resolve(model_config):
            calls.append("resolve")
            return SimpleNamespace(served_name="m")

        def __init__(self, *args):
            seen.append(torch.get_num_threads())

        def follow_free_cores(self):
            seen.append(torch.get_num_threads())  # serving starts from torch's own count

    monkeypatch.setattr(runner_module, "ModelRunner", Runner)
    snapshots = iter([snap(50.0, 1.0, 10.0), snap(51.5, 1.5, 11.0)])  # others: 1 core
    monkeypatch.setattr(compute_threads, "snapshot", lambda: next(snapshots))
    factory = DefaultRunnerFactory()
    factory.resolve(SimpleNamespace())
    factory(None)
    assert calls == ["resolve"] and seen == [1, 2]
    assert torch.get_num_threads() == 2


class Machine:
    """A clock and the snapshots `snapshot()` answers: each window of one second, other
    processes keep `others` cores busy and this process one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now, self.busy, self.own = 100.0, 0.0, 0.0
        monkeypatch.setattr(compute_threads, "snapshot", self.snapshot)
        monkeypatch.setattr(compute_threads.time, "monotonic", lambda: self.now)
        self.reads = 0

    def snapshot(self) -> CpuSnapshot:
        self.reads += 1
        return snap(self.busy, self.own, self.now)

    def second(self, others: float) -> None:
        self.now += 1.0
        self.busy += others + 1.0
        self.own += 1.0


def test_serving_follows_the_free_cores_once_two_windows_agree(two_threads, monkeypatch, caplog):
    machine = Machine(monkeypatch)
    threads = compute_threads.ServingThreads()
    counts = []
    for others in (0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.2, 1.0, 0.1, 0.0, 0.0):
        machine.second(others)
        with caplog.at_level(logging.INFO, logger="aioinfer"):
            threads.before_step()
        counts.append(torch.get_num_threads())
    # One busy window (a burst) changes nothing; two in a row do; and back the same way.
    assert counts == [2, 2, 2, 2, 1, 1, 1, 1, 1, 2, 2]
    lines = [r.getMessage() for r in caplog.records if "compute thread" in r.getMessage()]
    assert lines == [
        "Other processes keep 1.0 of 2 cores busy: 1 compute thread(s) now (was 2)",
        "Other processes keep 0.0 of 2 cores busy: 2 compute thread(s) now (was 1)",
    ]


def test_serving_reads_the_counters_once_a_window_however_many_steps(two_threads, monkeypatch):
    machine = Machine(monkeypatch)
    threads = compute_threads.ServingThreads()
    for _ in range(3000):  # 1.5 s of steps
        machine.now += 0.0005
        threads.before_step()
    assert machine.reads == 2  # at the start, and once the window had passed


def test_one_thread_is_never_measured(monkeypatch):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        machine = Machine(monkeypatch)
        threads = compute_threads.ServingThreads()
        machine.second(0.0)
        threads.before_step()
        assert machine.reads == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(saved)


def test_a_resolve_too_short_to_measure_is_waited_out(two_threads, monkeypatch):
    """A model that resolves in milliseconds (a GGUF cache entry) leaves too few clock ticks
    to tell busy cores from free ones: the start waits out the rest of a sample."""
    slept: list[float] = []
    monkeypatch.setattr(compute_threads.time, "sleep", slept.append)
    before = compute_threads.snapshot()
    if before is None:
        pytest.skip("no /proc/stat")
    with compute_threads.start_threads(before):
        pass
    assert len(slept) == 1 and 0.05 < slept[0] <= compute_threads.SAMPLE_SECONDS
