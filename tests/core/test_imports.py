"""The package's import graph (issue 36): no cycle, and no import running back up the layers.

The graph is read from the checkout's source with `ast` (nothing is imported): every `import` and `from ... import`
counts, at module level and inside functions alike (a lazy import still ties the two modules together), and so does
`importlib.import_module("<literal>")`; only `if TYPE_CHECKING:` blocks, which never run, do not. An edge goes to the
module named (`from .x import f` -> `x`; `from . import x` -> the submodule `x` when there is one).

The layers, lowest first: the core (`kl_adapters` and its top-level modules), `adapters`, then `doctor` and `demo`
(side by side: neither imports the other), `measure` (reads configurations with the doctor), `demo.task`, and `cli`
on top. A module imports only from its own layer
and those below. The demo's drivers (`demo.run`, `demo.long_horizon_run`, `demo.task.driver`) are entry points:
nothing in the package but `cli` imports them, and what they share lives in `demo.output`.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kl_adapters"
#: layer -> the layers its modules may import from
MAY_IMPORT = {
    "core": {"core"},
    "adapters": {"core", "adapters"},
    "doctor": {"core", "adapters", "doctor"},
    "demo": {"core", "adapters", "demo"},
    "measure": {"core", "adapters", "doctor", "measure"},
    "demo.task": {"core", "adapters", "demo", "demo.task"},
    "cli": {"core", "adapters", "doctor", "measure", "demo", "demo.task", "cli"},
}
#: entry points: imported by `cli` only
DRIVERS = {"kl_adapters.demo.run", "kl_adapters.demo.long_horizon_run", "kl_adapters.demo.task.driver"}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its __init__.py)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import `from <level dots><name> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _nodes(node: ast.AST):
    """Every node under `node`, skipping the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        yield child
        if _type_checking(child):
            for other in child.orelse:
                yield other
                yield from _nodes(other)
        else:
            yield from _nodes(child)


def imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The package modules `name` (at `path`) imports: module -> first line."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.level, node.module) if node.level else node.module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"):
            text = node.args[0].value
            level = len(text) - len(text.lstrip("."))
            targets = [_absolute(name, is_package, level, text[level:] or None) if level else text]
        for target in targets:
            if target in known and target != name:
                found.setdefault(target, node.lineno)
    return found


@functools.cache
def graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    found = modules(root)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, dict[str, int] | set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a closed path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(_path(sorted(component), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def _path(component: list[str], edges) -> list[str]:
    """One closed path from the component's first module back to it (breadth first), to name in a failure."""
    start, inside = component[0], set(component)
    previous = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in edges.get(v, ()):
            if w == start:
                path = [v]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if w in inside and w not in previous:
                previous[w] = v
                queue.append(w)
    return component


def layer(module: str) -> str:
    rest = module.split(".")[1:]
    if rest[:1] == ["cli"]:
        return "cli"
    if rest[:2] == ["demo", "task"]:
        return "demo.task"
    if rest[:1] in (["adapters"], ["doctor"], ["measure"], ["demo"]):
        return rest[0]
    return "core"


def test_no_import_cycle():
    edges = graph()
    found = cycles(edges)
    assert not found, "import cycles (each a closed path; the line of each import):\n" + "\n".join(
        " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
        for cycle in found)


def test_no_import_runs_back_up():
    wrong = [f"{a} ({layer(a)}) imports {b} ({layer(b)}), line {line}"
             for a, targets in graph().items() for b, line in targets.items()
             if layer(b) not in MAY_IMPORT[layer(a)]]
    assert not wrong, wrong


def test_only_the_cli_imports_a_driver():
    wrong = [f"{a} imports the driver {b}, line {line}" for a, targets in graph().items()
             for b, line in targets.items() if b in DRIVERS and a != "kl_adapters.cli"]
    assert not wrong, wrong
    assert DRIVERS <= set(modules()), DRIVERS - set(modules())


def test_the_graph_itself(tmp_path: Path):
    """The reader and the cycle search on known cases (a reader that found no import would pass everything)."""
    edges = graph()
    assert set(MAY_IMPORT) == {layer(m) for m in edges}
    # module level, relative and absolute; inside a function; `from . import submodule`; import_module(".x")
    assert "kl_adapters.demo.output" in edges["kl_adapters.demo.run"]
    assert "kl_adapters.demo.long_horizon_run" in edges["kl_adapters.cli"]
    assert "kl_adapters.demo.report" in edges["kl_adapters.demo.run"]
    assert "kl_adapters.activation" in edges["kl_adapters"]
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from importlib import import_module\nimport_module('.a', __name__)\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                                  "def f():\n    from .sub import c\n")
    (package / "b.py").write_text("import kl_adapters.a\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from .. import b\nfrom ..a import f\n")
    small = graph(tmp_path)
    assert small == {"kl_adapters": {"kl_adapters.a": 2}, "kl_adapters.a": {"kl_adapters.sub.c": 5},
                     "kl_adapters.b": {"kl_adapters.a": 1}, "kl_adapters.sub": {},
                     "kl_adapters.sub.c": {"kl_adapters.b": 1, "kl_adapters.a": 2}}
    assert cycles(small) == [["kl_adapters.a", "kl_adapters.sub.c", "kl_adapters.a"]]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert layer("kl_adapters.demo.task.driver") == "demo.task" and layer("kl_adapters.surrogate") == "core"
