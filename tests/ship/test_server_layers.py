"""The layers of aioinfer/server, checked on the source with `ast`: every import counts, those
inside functions and under `if TYPE_CHECKING:` too.

- http/: infrastructure that knows no API; it imports only http/.
- serving/: what more than one API shares; it imports http/ and serving/.
- an API package (openai/, responses/, anthropic/, pooling/): http/, serving/ and itself; never
  another API.
- the composition root (app.py, routes.py, openapi.py, launch.py): anything. Nothing below it
  imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "aioinfer" / "server"
PREFIX = "aioinfer.server"
INFRASTRUCTURE, SHARED = "http", "serving"
APIS = frozenset({"openai", "responses", "anthropic", "pooling"})
ROOT = "root"
ROOT_MODULES = frozenset({"__init__", "app", "routes", "openapi", "launch"})
# What each layer may import of aioinfer.server (an API package also imports itself).
ALLOWED = {
    INFRASTRUCTURE: {INFRASTRUCTURE},
    SHARED: {INFRASTRUCTURE, SHARED},
    **{api: {INFRASTRUCTURE, SHARED, api} for api in APIS},
}


def layer_of_module(module: str) -> str | None:
    """The layer of a dotted module under aioinfer.server; None for a module outside it."""
    if module == PREFIX:
        return ROOT
    if not module.startswith(PREFIX + "."):
        return None
    top = module[len(PREFIX) + 1 :].split(".", 1)[0]
    if top in ALLOWED:
        return top
    if top in ROOT_MODULES:
        return ROOT
    raise AssertionError(f"{module}: not in any layer of aioinfer/server")


def module_name(rel: Path) -> str:
    """aioinfer.server's dotted name of a file, given relative to aioinfer/server."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join([PREFIX, *parts])


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every import in the source, wherever it sits; relative imports
    resolved against `module`; `from a.b import c` counts as a.b.c (c may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def violations(rel: Path, source: str) -> list[str]:
    """What a file under aioinfer/server (path relative to it) imports against the layers."""
    module = module_name(rel)
    layer = layer_of_module(module)
    if layer == ROOT:
        return []
    assert layer is not None
    bad = []
    for line, target in imported_modules(source, module, rel.name == "__init__.py"):
        # `from aioinfer.server.http import errors` names the package http, and errors in it.
        target_layer = layer_of_module(target)
        if target_layer is None or target_layer in ALLOWED[layer]:
            continue
        bad.append(f"{rel}:{line} ({layer}) imports {target} ({target_layer})")
    return bad


def source_files() -> list[Path]:
    return sorted(SERVER.rglob("*.py"))


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(SERVER)))
def test_server_layers(path: Path) -> None:
    rel = path.relative_to(SERVER)
    assert not violations(rel, path.read_text())


def test_every_server_file_is_in_a_layer() -> None:
    for path in source_files():
        rel = path.relative_to(SERVER)
        if len(rel.parts) == 1:
            assert rel.stem in ROOT_MODULES, f"{rel}: a new file of the composition root?"
        else:
            assert rel.parts[0] in ALLOWED, f"{rel}: a package in no layer"


PLANTED = """
from __future__ import annotations

from typing import TYPE_CHECKING

from aioinfer.server.http.errors import APIError

if TYPE_CHECKING:
    from aioinfer.server.serving.context import ResponseContext


def handler():
    from aioinfer.server.openai import completions

    import aioinfer.server.routes
    from .. import anthropic
    from ..responses.store import ResponseStore
"""


def test_the_rule_catches_planted_violations() -> None:
    found = violations(Path("http/planted.py"), PLANTED)
    targets = {message.split(" imports ")[1].split(" ")[0] for message in found}
    assert targets == {
        "aioinfer.server.serving.context.ResponseContext",  # under TYPE_CHECKING
        "aioinfer.server.openai.completions",  # inside a function
        "aioinfer.server.routes",
        "aioinfer.server.anthropic",  # relative
        "aioinfer.server.responses.store.ResponseStore",
    }
    # The same source in an API package: only other APIs and the root are wrong there.
    found = violations(Path("openai/planted.py"), PLANTED)
    assert len(found) == 3 and all("(openai) imports" in message for message in found)
    assert not any("openai.completions" in message for message in found)
    # serving/ may import http/ and itself, never an API.
    assert violations(Path("serving/planted.py"), "from aioinfer.server.pooling import scores")
    assert not violations(Path("serving/planted.py"), "from aioinfer.server.http import sse")
    assert not violations(Path("app.py"), PLANTED)
