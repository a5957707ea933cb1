"""Imports flow one way: messages -> actors -> runtime, and inside runtime from its top
(what an engine embeds) to testing, demo, bench and the command line. An ast walk over
every module of the three packages finds each import (those only for type checking
too); an arrow the wrong way, a cycle, or an import inside a function (the usual way
to dodge a cycle) fails, unless it is listed below with its reason."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"messages": "hicache.messages", "actors": "hicache.actors", "runtime": "hicache.runtime"}

RANKS = {
    "hicache.messages": 0,
    "hicache.actors": 1,
    "hicache.runtime": 2,
    "hicache.runtime.testing": 3,
    "hicache.runtime.demo": 4,
    "hicache.runtime.bench": 5,
    "hicache.runtime.cli": 6,
}
"""The rooms, lowest first: a module may import its own room and the rooms below it."""

RE_EXPORTS = {
    "hicache.runtime.explore": "where users import exploration; it lives in hicache.runtime.testing",
    "hicache.runtime.oracle": "where users import the fingerprint oracle; it lives in hicache.runtime.testing",
}
"""Modules that only hand on a higher room's names under the path users import them by."""

LAZY = {
    ("hicache.runtime.cli", "hicache"): "the command line loads a command's modules when it runs: "
                                        "`hicache --help` imports neither torch nor the actors",
    ("hicache.actors._mooncake", "mooncake"): "the optional mooncake extra, needed only with Mooncake storage",
    ("hicache.runtime._group", "torch"): "torch.distributed, needed only with a tensor-parallel group",
    ("hicache.runtime.demo._tiny_model", "transformers"): "the optional model extra, needed only to build a model",
    ("hicache.runtime.demo._demo_model", "transformers"): "the optional model extra, needed only for `demo --model`",
    ("hicache.runtime.demo._simulate_plot", "matplotlib"): "heavy; needed only for `simulate --plot`",
}
"""(importing module, top package of what it imports) pairs allowed inside a function."""

DYNAMIC = {
    "hicache.runtime._lazy": "the lazy exports (PEP 562) of hicache.runtime (its modules and hicache.actors) and of "
                             "hicache.runtime.demo (the model runner, so the demo runs without transformers)",
    "hicache.runtime.cli": "`hicache bench NAME` loads the bench module it runs",
    "hicache.messages._doc": "the generator of docs/messages.md reads each messages module of its own package by name",
}
"""Modules allowed to call importlib.import_module."""


@dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    line: int
    in_function: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py"))}


MODULES = _modules()


def _target(source: str, path: Path, node: ast.ImportFrom, alias: ast.alias) -> str:
    if node.level:
        package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    submodule = f"{base}.{alias.name}"
    return submodule if submodule in MODULES else base


def _arrows(source: str, path: Path) -> Iterator[Arrow]:
    def walk(node: ast.AST, in_function: bool) -> Iterator[Arrow]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Arrow(source, alias.name, child.lineno, in_function)
            elif isinstance(child, ast.ImportFrom):
                for alias in child.names:
                    yield Arrow(source, _target(source, path, child, alias), child.lineno, in_function)
            yield from walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    yield from walk(ast.parse(path.read_text(), str(path)), False)


ARROWS = [arrow for source, path in MODULES.items() for arrow in _arrows(source, path)]


def _room(module: str) -> str:
    return max((r for r in RANKS if module == r or module.startswith(r + ".")), key=len)


def _where(arrow: Arrow) -> str:
    return f"{MODULES[arrow.source].relative_to(ROOT)}:{arrow.line} ({arrow.source} -> {arrow.target})"


def test_no_arrow_runs_from_a_lower_room_to_a_higher_one() -> None:
    wrong = sorted({
        _where(a) for a in ARROWS
        if a.target.startswith("hicache.") and a.source not in RE_EXPORTS
        and RANKS[_room(a.target)] > RANKS[_room(a.source)]
    })
    assert not wrong, "imports the wrong way (messages -> actors -> runtime -> testing, demo, bench, cli):\n" + \
        "\n".join(wrong)


def _lazy_key(arrow: Arrow) -> tuple[str, str]:
    return arrow.source, arrow.target.split(".")[0]


def test_no_import_inside_a_function_unless_listed_with_its_reason() -> None:
    late = sorted({_where(a) for a in ARROWS if a.in_function and _lazy_key(a) not in LAZY})
    assert not late, "imports inside a function (import at the top, or list it in LAZY with why):\n" + \
        "\n".join(late)


def test_every_lazy_entry_is_still_used() -> None:
    used = {_lazy_key(a) for a in ARROWS if a.in_function}
    stale = sorted(set(LAZY) - used)
    assert not stale, f"LAZY entries no import needs any more: {stale}"


def test_only_the_listed_modules_import_by_name_at_run_time() -> None:
    calls = sorted(
        f"{MODULES[source].relative_to(ROOT)}:{node.lineno}"
        for source, path in MODULES.items() if source not in DYNAMIC
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "__import__"))
    )
    assert not calls, f"imports by name at run time (they hide arrows from this test): {calls}"


def test_the_module_level_imports_have_no_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a in ARROWS:
        if not a.in_function and a.target in MODULES:
            graph[a.source].add(a.target)
            parent = a.target.rsplit(".", 1)[0]  # importing a module runs its package first
            if parent in MODULES and parent != a.source and not a.source.startswith(parent + "."):
                graph[a.source].add(parent)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("a cycle of module-level imports: " + " -> ".join(cycle))


def test_the_lazy_exports_of_hicache_runtime_point_down() -> None:
    import hicache.runtime

    wrong = [m for m in hicache.runtime._EXPORTS
             if RANKS[_room(m if m.startswith("hicache.") else f"hicache.runtime.{m}")] > RANKS["hicache.runtime"]]
    assert not wrong, f"hicache.runtime exports names of higher rooms (export them from their room): {wrong}"
