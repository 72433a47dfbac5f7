"""The package layout is the layering: which project package may import which, and no import cycles.

Imports are read from the source (every `import`, module level or inside a function), so a cycle hidden
behind a lazy import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specactor", "specactor_engine", "tasks", "flows", "benchmark")
# what each top-level package may import from the project (itself always)
ALLOWED = {
    "specactor_engine": set(),
    "tasks": {"specactor_engine"},
    "flows": {"specactor_engine", "tasks"},
    "benchmark": {"specactor_engine", "tasks"},
    "specactor": {"specactor_engine", "tasks", "flows", "benchmark"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from a import b` counts `a.b` when that is a module)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # importing a.b.c first runs a/__init__ and a/b/__init__, unless this module is inside them already
    own = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
    parents = {target.rsplit(".", depth)[0] for target in found for depth in range(1, target.count(".") + 1)}
    return found | {parent for parent in parents - own if parent in modules and parent != name}


def _graph() -> dict[str, set[str]]:
    modules = _project_modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from specactor_engine.engine import Engine\n")
    assert _imports(source, "x", {"specactor_engine.engine": source}) == {"specactor_engine.engine"}


def test_importing_a_submodule_counts_its_package_init(tmp_path: Path) -> None:
    """`from a.sub import x` runs a/__init__ first: a cycle through a package's eager imports is found."""
    runner, vocab = tmp_path / "runner.py", tmp_path / "vocab.py"
    runner.write_text("from pkg.drafters.vocab import head\n")
    vocab.write_text("")
    modules = {"pkg.model.runner": runner, "pkg.drafters.vocab": vocab, "pkg.drafters": vocab, "pkg.model": vocab}
    assert _imports(runner, "pkg.model.runner", modules) == {"pkg.drafters.vocab", "pkg.drafters"}


def test_no_import_cycles_between_project_modules() -> None:
    assert _cycles(_graph()) == []


def test_each_package_imports_only_the_layers_below_it() -> None:
    graph = _graph()
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                   if target.split(".")[0] != module.split(".")[0]
                   and target.split(".")[0] not in ALLOWED[module.split(".")[0]])
    assert wrong == []
