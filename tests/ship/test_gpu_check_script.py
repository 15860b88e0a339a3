"""scripts/gpu_check.sh and scripts/gpu_wheels.sh, checked on the CPU: both parse, the wheels
never include torch, triton or nvidia packages, every step has a SIGINT time limit, and a dry run
(GPU_CHECK_DRY_RUN=1, with a fake `python3` and `nvidia-smi` first on PATH) runs every step and
leaves no more than the 8 files that a lent GPU machine sends back."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
MAX_FILES = 8
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
# The kernel step runs the folder of the Triton kernels' tests, each file whole; the engine step
# the tests marked `gpu` of the engine-level files, one at a time.
KERNEL_DIR = "tests/model/kernels"
KERNEL_TESTS = [
    "tests/model/kernels/test_triton_kernels.py",
    "tests/model/kernels/test_triton_layers.py",
    "tests/model/kernels/test_fused_moe.py",
    "tests/model/kernels/test_triton_gpu.py",
    "tests/model/kernels/test_kv_index_range.py",
]
ENGINE_TESTS = [
    "tests/gpu/test_bf16_parity.py",
    "tests/gpu/test_constraints_gpu.py",
    "tests/gpu/test_cuda_graphs.py",
    "tests/gpu/test_embeddings_gpu.py",
    "tests/gpu/test_host_sync.py",
    "tests/model/test_moe_gpu.py",
]
GPU_MARK = re.compile(r"^(?:pytestmark = pytest\.mark\.gpu|\s*@pytest\.mark\.gpu)\b", re.M)
FAKE = '#!/bin/sh\necho "fake $(basename "$0") $*"\n'
# A python3 whose import check (the script's `python3 -` with a program on stdin) fails.
FAKE_BROKEN_PYTHON = (
    '#!/bin/sh\nif [ "$1" = "-" ]; then echo "versions: pydantic MISSING"; exit 1; fi\n'
    'echo "fake python3 $*"\n'
)

# A python3 for a run without the dry run: the kernel tests fail where FAKE_KERNELS_FAIL=1, the
# engine tests pass, and the latency bench logs a Triton kernel's fallback to torch.
FAKE_GPU_PYTHON = """#!/bin/sh
case "$*" in
  *"-m pytest"*"-n 8"*) if [ "$FAKE_KERNELS_FAIL" = 1 ]; then
                          echo "FAILED tests/model/test_k.py::test_k - assert 1 == 2"
                          echo "1 failed, 3 passed in 1.00s"; exit 1
                        fi
                        echo "4 passed in 1.00s" ;;
  *"-m pytest"*) echo "=========== 5 passed in 2.00s ===========" ;;
  *"bench latency"*) echo "WARNING The triton RMSNorm kernel is not used on this device: 0.5" ;;
  -) echo "versions: fake" ;;
esac
"""


def code_lines(path: Path) -> list[str]:
    """The script's lines without comments, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", path.read_text())
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def wheel_list() -> list[str]:
    text = WHEELS.read_text()
    match = re.search(r"^WHEELS=\((.*?)^\)", text, re.S | re.M)
    assert match, "gpu_wheels.sh lists its wheels in WHEELS=( ... )"
    return match.group(1).split()


def run_check(
    tmp_path: Path, python: str = FAKE, dry_run: bool = True, **extra_env: str
) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", python), ("nvidia-smi", FAKE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "WHEELS_DIR")}
    env.pop("GPU_CHECK_DRY_RUN", None)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    if dry_run:
        env["GPU_CHECK_DRY_RUN"] = "1"
    env.update(extra_env)
    results = tmp_path / "r"
    proc = subprocess.run(
        ["bash", str(CHECK), str(results)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    return proc, results


def commands(results: Path) -> list[list[str]]:
    """The command lines that the dry run wrote into its logs instead of running them."""
    out = []
    for log in sorted(results.glob("*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("$ "):
                out.append(shlex.split(line[2:]))
    return out


def files_a_real_run_writes(results: Path) -> set[str]:
    """The files the dry run left, and those that the commands it skipped would have written."""
    names = {p.name for p in results.iterdir()}
    for argv in commands(results):
        names |= {Path(arg).name for arg in argv if arg.startswith(f"{results}/")}
    return names


def selects(argv: list[str], path: str) -> bool:
    """Whether a pytest command line names the test file, or a folder above it."""
    return any(
        path == arg.split("::")[0] or path.startswith(arg.rstrip("/") + "/")
        for arg in argv
        if arg.startswith("tests/")
    )


@pytest.mark.parametrize("script", [CHECK, WHEELS], ids=lambda p: p.name)
def test_script_parses(script: Path):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_wheels_are_pinned_and_leave_torch_alone():
    wheels = wheel_list()
    names = [re.split(r"==", w)[0].lower().replace("_", "-") for w in wheels]
    assert all("==" in w for w in wheels), wheels
    assert not [n for n in names if re.match(r"(torch|triton|nvidia)\b", n)], names
    assert {"xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "orjson", "gguf"} <= set(
        names
    )
    download = next(ln for ln in code_lines(WHEELS) if "pip download" in ln)
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version 3.12"):
        assert flag in download


def test_every_timeout_sends_sigint_and_pip_never_resolves():
    timeouts = pip_installs = 0
    for line in code_lines(CHECK):
        for match in re.finditer(r"(?<![\w-])timeout\s+(.*)", line):
            timeouts += 1
            assert match.group(1).startswith("-s INT "), line
        if "pip install" in line:
            pip_installs += 1
            for flag in ("--no-index", "--no-deps", "--target"):
                assert flag in line, line
            assert " -e " not in line, line
    assert timeouts >= 2 and pip_installs == 1


def test_dry_run_runs_every_step_into_at_most_eight_files(tmp_path: Path):
    proc, results = run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (results / "summary.txt").read_text()
    assert summary.strip() in proc.stdout  # the summary is what the run prints last

    written = files_a_real_run_writes(results)
    assert len(written) <= MAX_FILES, sorted(written)
    assert all(SAFE_NAME.match(name) for name in written), sorted(written)
    assert not [p for p in results.rglob("*") if p.is_dir()]
    assert "install.log" not in written  # kept only on a failure, inside the summary
    # Every file the script can name in the results folder, whichever branches a run takes
    # (engine.log only where scripts/gpu_engine_check.py exists); install.log is never left.
    named = set(re.findall(r"\$RESULTS/([A-Za-z0-9._-]+)", "\n".join(code_lines(CHECK))))
    assert written <= named and len(named - {"install.log"}) <= MAX_FILES, sorted(named)

    steps = ["install", "kernel tests", "engine tests", "engine check", "latency"]
    steps += ["step profile", "throughput"]
    lines = summary.splitlines()
    for step in steps:
        assert any(ln.startswith(step + " ") for ln in lines), f"no {step!r} line:\n{summary}"
    assert summary.index("-- phase 1") < summary.index("latency") < summary.index("-- phase 2")
    assert summary.index("-- phase 2") < summary.index("throughput")

    for log in results.glob("*.log"):  # the steps' commands were written down, not run
        assert "fake " not in log.read_text(), log.name
    runs = commands(results)
    pytests = [argv for argv in runs if argv[1:3] == ["-m", "pytest"]]
    assert len(pytests) == 2, runs
    kernels, engine = pytests
    for argv in pytests:
        assert "--durations=15" in argv and "no:cacheprovider" in argv
    assert kernels[kernels.index("-n") + 1] == "8"
    assert [a for a in kernels if a.startswith("tests/")] == [KERNEL_DIR]
    assert "-m" not in kernels[3:]  # each kernel file runs whole
    assert engine[engine.index("-m", 3) + 1] == "gpu"
    assert not [a for a in engine if a.startswith(KERNEL_DIR)], engine
    for path in KERNEL_TESTS:
        assert (ROOT / path).is_file() and selects(kernels, path), path
    for path in ENGINE_TESTS:
        assert GPU_MARK.search((ROOT / path).read_text()), f"{path} has no test marked gpu"
        assert selects(engine, path), (path, engine)
    # Every test file with tests marked `gpu` runs in one of the two steps.
    marked = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if GPU_MARK.search(p.read_text())
    ]
    assert len(marked) >= len(ENGINE_TESTS) + 2, marked
    assert [p for p in marked if not (selects(kernels, p) or selects(engine, p))] == []
    plan_source = (ROOT / "tests" / "ship" / "test_plan.py").read_text()
    on_cuda = "tests/ship/test_plan.py::test_plan_matches_serve_on_cuda"
    assert (on_cuda in engine) == ("def test_plan_matches_serve_on_cuda(" in plan_source)

    def ran(*words: str) -> bool:
        return any(all(w in argv for w in words) for argv in runs)

    assert ran("aioinfer", "bench", "latency", "--input-len", "128", "--output-len", "128")
    assert ran("scripts/gpu_step_profile.py")
    assert ran("aioinfer", "bench", "throughput", "--vs", "transformers", "--num-prompts", "256")
    engine_check = (ROOT / "scripts" / "gpu_engine_check.py").exists()
    assert ran("scripts/gpu_engine_check.py") == engine_check


def test_failed_imports_stop_the_check_with_the_install_log_in_the_summary(tmp_path: Path):
    proc, results = run_check(tmp_path, python=FAKE_BROKEN_PYTHON)
    assert proc.returncode == 1
    summary = (results / "summary.txt").read_text()
    assert re.search(r"^install\s.*FAILED", summary, re.M), summary
    assert "pydantic MISSING" in summary
    assert {p.name for p in results.iterdir()} <= {"summary.txt", "tests.log"}


def test_a_run_reports_failed_tests_and_triton_fallbacks(tmp_path: Path):
    proc, results = run_check(tmp_path, FAKE_GPU_PYTHON, dry_run=False, FAKE_KERNELS_FAIL="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (results / "summary.txt").read_text()
    assert re.search(r"^kernel tests .*FAILED \(exit 1\)\s+1 failed, 3 passed in", summary, re.M)
    assert "FAILED tests/model/test_k.py::test_k - assert 1 == 2" in summary
    assert re.search(r"^engine tests .* ok\s+5 passed in 2.00s$", summary, re.M), summary
    assert re.search(r"^latency .* ok", summary, re.M)
    fallback = r"^triton .*FAILED.*\n\./latency\.log:WARNING The triton RMSNorm kernel is not used"
    assert re.search(fallback, summary, re.M), summary
    assert "versions: fake" in summary
    assert len(list(results.iterdir())) <= MAX_FILES


def test_a_triton_fallback_alone_fails_the_run(tmp_path: Path):
    proc, results = run_check(tmp_path, FAKE_GPU_PYTHON, dry_run=False, FAKE_KERNELS_FAIL="0")
    summary = (results / "summary.txt").read_text()
    assert re.search(r"^kernel tests .* ok\s+4 passed in 1.00s$", summary, re.M), summary
    assert not re.search(r"^(?!triton ).*FAILED", summary, re.M), summary
    assert re.search(r"^triton .*FAILED", summary, re.M), summary
    assert proc.returncode == 1
