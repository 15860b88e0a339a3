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
    "server/http/request_model.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/http/validation.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/serving/protocol.py": {"torch", "asyncio", "triton"},
    "server/serving/shapes.py": {"torch", "asyncio", "triton"},
    "server/serving/context.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/serving/logprobs_render.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/serving/output_parts.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/openapi.py": {"torch", "asyncio", "triton"},
    "server/openai/protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/openai/shapes.py": {"torch", "asyncio", "triton"},
    "server/openai/render.py": {"torch", "asyncio", "triton"},
    "server/openai/tokenize_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/responses/protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/responses/render.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/responses/store.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/anthropic/protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/anthropic/render.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/pooling/embeddings_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/pooling/classify_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
    "server/pooling/scores_protocol.py": {"torch", "asyncio", "aiohttp", "triton"},
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
