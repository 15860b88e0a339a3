"""The import direction of ../shared/DESIGN.md, checked on the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "aioinfer"

# Modules (by path prefix) and the top-level imports they must not make.
FORBIDDEN = {
    "core/": {
        "torch",
        "asyncio",
        "aiohttp",
        "triton",
        "aioinfer.engine",
        "aioinfer.gpu",
        "aioinfer.model",
        "aioinfer.server",
    },
    "config.py": {"torch", "asyncio", "aiohttp", "triton"},
    "sizing.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/protocol.py": {"torch", "asyncio", "triton"},
    "server/responses.py": {"torch", "asyncio", "triton"},
    "server/render.py": {"torch", "asyncio", "triton"},
    "server/logprobs_render.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/openapi.py": {"torch", "asyncio", "triton"},
    "server/responses_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/responses_render.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/responses_store.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/output_parts.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/messages_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/messages_render.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/embeddings_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/classify_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/scores_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/tokenize_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "engine/": {"torch", "triton", "aioinfer.model", "aioinfer.server"},
    "gpu/": {"asyncio", "aiohttp", "aioinfer.engine", "aioinfer.server"},
    "model/": {"asyncio", "aiohttp", "aioinfer.engine", "aioinfer.server"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def violates(module: str, banned: set[str]) -> bool:
    return any(module == b or module.startswith(b + ".") for b in banned)


def source_files():
    return sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path):
    rel = path.relative_to(PACKAGE).as_posix()
    for prefix, banned in FORBIDDEN.items():
        if rel.startswith(prefix):
            bad = sorted(m for m in imported_modules(path) if violates(m, banned))
            assert not bad, f"{rel} imports {bad}"


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import torch\nfrom asyncio import Queue\n")
    assert {m for m in imported_modules(bad) if violates(m, FORBIDDEN["core/"])} == {
        "torch",
        "asyncio",
    }
