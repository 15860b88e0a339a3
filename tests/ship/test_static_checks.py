"""The package passes its linters and type checker, as `make lint` runs them: ruff (rules and
formatting) over the code and tests, mypy over the package with pyproject's settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_rules_and_format() -> None:
    for args in (
        ("ruff", "check", "aioinfer", "tests"),
        ("ruff", "format", "--check", "aioinfer", "tests"),
    ):
        result = _run(*args)
        assert result.returncode == 0, result.stdout + result.stderr


def test_mypy(tmp_path: Path) -> None:
    # A cache of this test's own, so a user's stale cache cannot hide or invent errors.
    result = _run("mypy", "--cache-dir", str(tmp_path / "mypy"), "aioinfer")
    assert result.returncode == 0, result.stdout + result.stderr
