"""The package's layers (docs/architecture.md, "Layout"): no import cycle, no import hidden in a
function to dodge one, and no layer importing one above it. Read from the source's own import
statements, so a new module is checked without being listed here."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hvd_slim"
# Lower layers first: a module may import its own layer's and the ones before it.
LAYERS = ["wire", "config", "selection", "memory", "transport", "runtime", "exchange", "outer",
          "api", "optim", "ddp", "elastic"]
# Imported inside functions on purpose: importing mpi4py initialises MPI, which
# ``import hvd_slim`` must not do (a Gloo or NCCL job, a machine without MPI).
LAZY = {"hvd_slim.transport.mpi", "hvd_slim.transport.mpi_api", "hvd_slim.transport.mpi_comm",
        "hvd_slim.transport.mpi_device"}


def _modules() -> Dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("hvd_slim",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> Tuple[Set[str], List[Tuple[str, int]]]:
    """(module-level targets, [(function-level target, line)]) of module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top: Set[str] = set()
    local: List[Tuple[str, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue   # annotations only
            if isinstance(child, ast.ImportFrom) and child.level:
                base = package.split(".")[:len(package.split(".")) - child.level + 1]
                target = ".".join(base + ([child.module] if child.module else []))
                for alias in child.names:
                    full = f"{target}.{alias.name}"
                    dest = full if full in MODULES else target
                    (local.append((dest, child.lineno)) if in_function else top.add(dest))
            visit(child, inner)
    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return top, local


IMPORTS = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_there_is_no_import_cycle():
    def ancestors(name: str) -> Set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}
    # Importing a.b.c runs a and a.b first, except the packages the importer is already inside.
    graph = {name: {t for dest in top for t in ancestors(dest) | {dest}
                    if t in MODULES and t != name and (t == dest or t not in ancestors(name))}
             for name, (top, _) in IMPORTS.items()}
    done: Set[str] = set()

    def walk(name: str, path: List[str]) -> None:
        if name in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for nxt in sorted(graph[name]):
            walk(nxt, path + [name])
        done.add(name)
    for name in sorted(graph):
        walk(name, [])


def test_imports_inside_functions_are_only_the_mpi_ones_kept_lazy():
    hidden = [(name, dest, line) for name, (_, local) in IMPORTS.items()
              for dest, line in local if dest not in LAZY]
    assert not hidden, hidden


def test_no_layer_imports_one_above_it():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for name, (top, local) in IMPORTS.items():
        mine = _layer(name)
        for dest in list(top) + [d for d, _ in local]:
            theirs = _layer(dest)
            if mine in rank and theirs in rank and rank[theirs] > rank[mine]:
                upward.append(f"{name} imports {dest}")
    assert not upward, upward


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 100   # the package was found
    assert {_layer(n) for n in MODULES} - {""} <= set(LAYERS)
