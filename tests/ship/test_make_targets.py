"""The README's set-up commands are make targets that exist (`make -n` resolves them without
running them); running them on a fresh virtual environment is a CI step."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"serve": "aioinfer serve", "test": "pytest"}


def readme_make_targets() -> list[str]:
    """The targets of the `make X` lines in the README's first shell block."""
    block = re.search(r"```(?:bash|sh|console)\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README has no shell block"
    return [m[1] for m in re.finditer(r"^\s*make (\S+)", block[1], re.M)]


def test_the_readme_starts_with_make_serve_and_make_test():
    assert set(readme_make_targets()) >= set(EXPECTED)


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_make_dry_run_resolves_the_target(target):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(
        ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "scripts/setup.sh" in result.stdout  # installs first
    assert EXPECTED[target] in result.stdout
