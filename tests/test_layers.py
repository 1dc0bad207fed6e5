"""The import graph of stepflow's modules: no cycles, and no import from a floor above (the floors are the list in
``stepflow/__init__.py``'s docstring). Every module is parsed, not imported; every import counts, at module level
and inside functions (an import run later is a dependency all the same); only ``if TYPE_CHECKING:`` blocks are left
out."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "stepflow"


def module_files(root: Path = PKG) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file (a package is its ``__init__.py``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = (root.name, *f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom of ``tree`` (in functions, classes, try blocks too), TYPE_CHECKING blocks aside."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports(name: str, source: str, modules: set[str], is_package: bool = False) -> dict[str, int]:
    """The stepflow modules that module ``name`` imports: target -> first line. ``from X import y`` depends on the
    module ``X.y`` when there is one, else on ``X``; ``import X.Y`` on ``X.Y``; a name that is no module is taken
    as its nearest enclosing module."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    pkg = name if is_package else name.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            t = resolve(t)
            if t is not None and t != name:
                out[t] = min(out.get(t, node.lineno), node.lineno)
    return out


def import_graph(root: Path = PKG) -> dict[str, dict[str, int]]:
    files = module_files(root)
    return {m: imports(m, f.read_text(), set(files), f.name == "__init__.py") for m, f in files.items()}


def floors(root: Path = PKG) -> dict[str, tuple[int, str]]:
    """The floors of ``stepflow/__init__.py``'s docstring: module or package name -> (floor, floor name)."""
    doc = ast.get_docstring(ast.parse((root / "__init__.py").read_text())) or ""
    items: list[str] = []
    for line in doc.splitlines():
        if re.match(r"\d+\. ", line):
            items.append(line)
        elif items and line.startswith("   ") and line.strip():
            items[-1] += " " + line.strip()
    out = {}
    for item in items:
        m = re.fullmatch(r"(\d+)\. ([^(:]+?)(?: \([^)]*\))?: (.+)", item)
        assert m, f"stepflow/__init__.py: cannot read the floor {item!r} (want 'N. name (what): mod, mod')"
        for mod in m.group(3).split(","):
            out[f"{root.name}.{mod.strip()}"] = (int(m.group(1)), m.group(2))
    return out


def floor_of(module: str, table: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The floor of the longest name in ``table`` that is ``module`` or a package holding it; the package
    ``stepflow`` itself (its version and this docstring) is the bottom."""
    if module == PKG.name:
        return (0, "package")
    while module:
        if module in table:
            return table[module]
        module = module.rpartition(".")[0]
    return None


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_graph_sees_every_kind_of_import():
    src = textwrap.dedent("""
        from typing import TYPE_CHECKING
        import stepflow.sde
        from stepflow import loss
        from stepflow.errors import StepflowError
        from . import window
        from .policies import base
        if TYPE_CHECKING:
            from stepflow.grpo import GRPOModule
        def f():
            from stepflow.algorithm import step_loss
        class C:
            def g(self):
                try:
                    import stepflow.rewards.remote
                except ImportError:
                    pass
        """)
    mods = {"stepflow", "stepflow.sde", "stepflow.loss", "stepflow.errors", "stepflow.window", "stepflow.policies",
            "stepflow.policies.base", "stepflow.grpo", "stepflow.algorithm", "stepflow.rewards",
            "stepflow.rewards.remote", "stepflow.data"}
    got = imports("stepflow.data", src, mods)
    assert set(got) == {"stepflow.sde", "stepflow.loss", "stepflow.errors", "stepflow.window",
                        "stepflow.policies.base", "stepflow.algorithm", "stepflow.rewards.remote"}, got
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_every_module_stands_on_a_floor():
    table = floors()
    files = module_files()
    assert len({f for f, _ in table.values()}) >= 6, table
    unknown = sorted(n for n in table if n not in files)
    assert not unknown, f"stepflow/__init__.py lists floors for modules that do not exist: {unknown}"
    homeless = sorted(m for m in files if floor_of(m, table) is None)
    assert not homeless, (f"modules on no floor: {homeless}; add each to the floor list of stepflow/__init__.py "
                          "(the lowest floor that holds everything it imports)")


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for comp in found:
        edges = [f"{a}:{graph[a][b]} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        lines.append(" + ".join(comp) + ": " + "; ".join(edges))
    assert not found, f"{len(found)} import cycle(s) among stepflow's modules:\n" + "\n".join(lines)


def test_no_import_from_a_higher_floor():
    table = floors()
    graph = import_graph()
    up = []
    for a, targets in sorted(graph.items()):
        fa = floor_of(a, table)
        for b, line in sorted(targets.items()):
            fb = floor_of(b, table)
            if fa is not None and fb is not None and fb[0] > fa[0]:
                up.append(f"{a}:{line} (floor {fa[0]} {fa[1]}) imports {b} (floor {fb[0]} {fb[1]})")
    assert not up, f"{len(up)} import(s) from a higher floor (move the name down, or pass it in):\n" + "\n".join(up)


def test_errors_import_nothing_from_stepflow():
    files = module_files()
    got = imports("stepflow.errors", files["stepflow.errors"].read_text(), set(files))
    assert not got, f"stepflow/errors.py is the bottom floor and imports {sorted(got)}"
