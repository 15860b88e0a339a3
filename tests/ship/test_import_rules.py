"""The import direction of ../shared/DESIGN.md, checked on the source with `ast`.

Every import counts: at module level, inside functions and under `if TYPE_CHECKING:`. Each
folder of aioinfer (and each top-level module) belongs to a layer, lowest first:

    base       config.py, sizing.py, bundled.py (stdlib only; they import only each other)
    core       core/ (pure)
    model      model/
    gpu        gpu/
    engine     engine/, startup_log.py
    offline    offline/ | server/ (the whole folder, whatever its subpackages)
    bench      bench/
    cli        cli/, __main__.py
    surface    aioinfer/__init__.py and vLLM's module paths: inputs.py, outputs.py, logprobs.py,
               pooling_params.py, sampling_params.py, lora/

A module imports its own folder and the layers below its own, never a layer above, nor another
folder of its own layer (offline/ and server/ never import each other). The public surface is
imported by nothing inside aioinfer; `from aioinfer import __version__` is the one exception.
The folders form no cycle, and no modules do outside server/ (counting all but type-only
imports: the types a module names may come from a module that imports it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "aioinfer"

# Lowest first; folders of one layer may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("base",),
    ("core",),
    ("model",),
    ("gpu",),
    ("engine", "startup_log"),
    ("offline", "server"),
    ("bench",),
    ("cli",),
    ("surface",),
]
# Top-level modules and folders whose folder is not their own name.
FOLDER_OF = {
    "config": "base",
    "sizing": "base",
    "bundled": "base",
    "__main__": "cli",
    "inputs": "surface",
    "outputs": "surface",
    "logprobs": "surface",
    "pooling_params": "surface",
    "sampling_params": "surface",
    "lora": "surface",
}
ALLOWED_FROM_SURFACE = {"aioinfer.__version__"}

# Modules (by path prefix) and the imports they must not make: the pure ones stay free of torch
# and of the event loop.
FORBIDDEN = {
    "core/": {"torch", "asyncio", "aiohttp", "triton"},
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
    "engine/": {"torch", "triton"},
    "offline/": {"torch", "triton"},
    "gpu/": {"asyncio", "aiohttp"},
    "model/": {"asyncio", "aiohttp"},
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. aioinfer.offline.llm
    target: str  # the module (or, for a name of the package root, aioinfer.NAME) imported
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`
    root_name: bool = False  # a name the package root defines (`from aioinfer import LLM`)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    """Whether `name` (aioinfer.x.y) is a module or package under `root`."""
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                nodes.update(id(n) for n in ast.walk(child))
    return nodes


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    """Every import of a module of `root`'s package in the file at `path`."""
    module = module_name(path, root)
    package = root.name
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        targets: list[tuple[str, bool]] = []
        if isinstance(node, ast.Import):
            targets = [(alias.name, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                name = f"{source}.{alias.name}"
                # A submodule (`from aioinfer.model import llama`) or a name of the package
                # root (`from aioinfer import LLM`) is the import of that; else the module's.
                if is_module(name, root):
                    targets.append((name, False))
                else:
                    targets.append((name, True) if source == package else (source, False))
        for target, root_name in targets:
            if target == package or target.startswith(package + "."):
                yield Import(module, target, node.lineno, id(node) in type_only, root_name)


def folder_of(module: str, root_name: bool = False) -> str:
    """The folder (unit of the layer rules) a module of aioinfer belongs to; `root_name`: a name
    of the package root."""
    parts = module.split(".")
    if len(parts) == 1 or root_name:
        return "surface"  # the package root
    return FOLDER_OF.get(parts[1], parts[1])


def layer_of(folder: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) if folder in names), None)


def violations(root: Path) -> list[str]:
    """Every import that goes up a layer, sideways to another folder of its layer, or to the
    public surface."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for imp in imports_of(path, root):
            here, there = folder_of(imp.module), folder_of(imp.target, imp.root_name)
            mine, theirs = layer_of(here), layer_of(there)
            where = f"{path.relative_to(root).as_posix()}:{imp.line} imports {imp.target}"
            if mine is None or theirs is None:
                found.append(f"{where}: folder {here if mine is None else there!r} has no layer")
            elif imp.target in ALLOWED_FROM_SURFACE:
                continue
            elif there == "surface":
                found.append(f"{where}: the public surface is imported by nothing")
            elif here == there:
                continue
            elif theirs > mine:
                found.append(f"{where}: {there} is above {here}")
            elif theirs == mine:
                found.append(f"{where}: {there} is beside {here} (same layer)")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def all_imports(root: Path) -> Iterable[Import]:
    for path in sorted(root.rglob("*.py")):
        yield from imports_of(path, root)


def folder_edges(root: Path) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in all_imports(root):
        here, there = folder_of(imp.module), folder_of(imp.target, imp.root_name)
        if here != there:
            edges.setdefault(here, set()).add(there)
    return edges


def module_edges(root: Path, skip: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Module -> the modules it imports (type-only imports aside), `skip`'s folders left out."""
    edges: dict[str, set[str]] = {}
    for imp in all_imports(root):
        target = root.name if imp.root_name else imp.target
        if imp.type_only or target == imp.module or folder_of(imp.module) in skip:
            continue
        if folder_of(target) not in skip:
            edges.setdefault(imp.module, set()).add(target)
    return edges


def source_files():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def external_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def banned(module: str, names: set[str]) -> bool:
    return any(module == b or module.startswith(b + ".") for b in names)


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_pure_modules_import_no_torch_or_event_loop(path):
    rel = path.relative_to(PACKAGE).as_posix()
    for prefix, names in FORBIDDEN.items():
        if rel.startswith(prefix):
            bad = sorted(m for m in external_imports(path) if banned(m, names))
            assert not bad, f"{rel} imports {bad}"


def test_imports_point_down_the_layers():
    assert violations(PACKAGE) == []


def test_the_base_modules_import_only_each_other():
    base = {f"aioinfer.{name}" for name, folder in FOLDER_OF.items() if folder == "base"}
    for name in sorted(base):
        path = PACKAGE / f"{name.removeprefix('aioinfer.')}.py"
        assert {imp.target for imp in imports_of(path, PACKAGE)} <= base, name


def test_folders_form_no_cycle():
    assert cycles(folder_edges(PACKAGE)) == []


def test_modules_form_no_cycle_outside_the_server():
    assert cycles(module_edges(PACKAGE, skip=("server",))) == []


# -- the checker itself, on planted packages ---------------------------------------------------


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "aioinfer"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_the_checker_catches_an_upward_import(tmp_path):
    root = plant(
        tmp_path,
        {
            "config.py": "",
            "core/a.py": "def f():\n    from aioinfer.model.b import g\n",
            "model/b.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from aioinfer.gpu import c\n",
            "gpu/c.py": "from aioinfer import LLM, __version__\n",
            "offline/d.py": "from aioinfer.server import e\n",
            "server/e.py": "from aioinfer.config import X\nfrom aioinfer.core import a\n",
            "elsewhere.py": "",
            "cli/f.py": "import aioinfer.elsewhere\n",
        },
    )
    found = violations(root)
    assert found == [
        "cli/f.py:1 imports aioinfer.elsewhere: folder 'elsewhere' has no layer",
        "core/a.py:2 imports aioinfer.model.b: model is above core",
        "gpu/c.py:1 imports aioinfer.LLM: the public surface is imported by nothing",
        "model/b.py:3 imports aioinfer.gpu.c: gpu is above model",
        "offline/d.py:1 imports aioinfer.server.e: server is beside offline (same layer)",
    ]


def test_the_checker_catches_a_cycle(tmp_path):
    root = plant(
        tmp_path,
        {
            "core/a.py": "from aioinfer.model import b\n",
            "model/b.py": "def f():\n    import aioinfer.core.a\n",
            "model/loader/c.py": "from aioinfer.model.loader.d import x\n",
            "model/loader/d.py": "def f():\n    from aioinfer.model.loader import c\n",
            "model/loader/e.py": "from typing import TYPE_CHECKING\n"
            "from aioinfer.model.loader.c import y\n"
            "if TYPE_CHECKING:\n    from aioinfer.model.loader.e2 import z\n",
            "model/loader/e2.py": "from aioinfer.model.loader.e import w\n",
        },
    )
    assert cycles(folder_edges(root)) == [["core", "model"]]
    assert cycles(module_edges(root)) == [
        ["aioinfer.core.a", "aioinfer.model.b"],
        ["aioinfer.model.loader.c", "aioinfer.model.loader.d"],
    ]


def test_the_pure_rule_catches_torch(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    import torch\nfrom asyncio import Queue\n")
    assert {m for m in external_imports(bad) if banned(m, FORBIDDEN["core/"])} == {
        "torch",
        "asyncio",
    }


@pytest.mark.parametrize("prefix", sorted(FORBIDDEN))
def test_every_rule_names_a_module_that_exists(prefix):
    """A rule for a path that moved would pass silently: each must still match something."""
    assert (PACKAGE / prefix).exists(), f"{prefix} names no module: update FORBIDDEN"
