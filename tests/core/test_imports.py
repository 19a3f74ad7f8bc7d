"""The package's import graph (issue 36): no cycle, and no import running back up the layers.

The graph is read from the checkout's source with `ast` (nothing is imported): every `import` and `from ... import`
counts, at module level and inside functions alike (a lazy import still ties the two modules together), in
`if TYPE_CHECKING:` blocks too (a type-only import ties them as well), and so does
`importlib.import_module("<literal>")`; a module that calls `import_module` with a computed name imports every package
module it names by its dotted name in a string literal (the adapters' loader's `ADAPTERS` table). An edge goes to the
module named (`from .x import f` -> `x`; `from . import x` -> the submodule `x` when there is one). Every edge counts:
the checks below read the whole graph, with no exemption.

The layers, lowest first: the core (the package's top-level modules: `activation`, the switch and its state, among
them), `adapters` (with `adapters.loader`, which loads the three framework adapters by name when a framework is
imported), then `doctor` and `demo` (side by side: neither imports the other), `measure` (reads configurations with
the doctor), `demo.task`, and `cli`; the package itself (`kl_adapters/__init__.py`, the facade) is the top: it alone
imports both the switch and the loader, attaching the one to the other, and no module imports it. A module imports
only from its own layer and those below. The demo's drivers (`demo.run`, `demo.long_horizon_run`, `demo.task.driver`)
are entry points: nothing in the package but `cli` imports them, and what they share lives in `demo.output`.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kl_adapters"
#: layer -> the layers its modules may import from
MAY_IMPORT = {
    "facade": {"core", "adapters"},
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


def imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The package modules `name` (at `path`) imports: module -> first line."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
    computed = any(isinstance(node, ast.Call) and _calls_import_module(node)
                   and not (node.args and isinstance(node.args[0], ast.Constant)) for node in nodes)
    for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.level, node.module) if node.level else node.module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _calls_import_module(node)):
            text = node.args[0].value
            level = len(text) - len(text.lstrip("."))
            targets = [_absolute(name, is_package, level, text[level:] or None) if level else text]
        elif computed and isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            targets = [node.value]  # a dotted module name (a bare "kl_adapters" is a logger's name)
        for target in targets:
            if target in known and target != name:
                found.setdefault(target, node.lineno)
    return found


def _calls_import_module(node: ast.Call) -> bool:
    return getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"


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
    if not rest:
        return "facade"
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
    # module level, relative and absolute; inside a function; `from . import submodule`; import_module(".x"); a
    # computed import_module and the names in its module's table; a type-only import
    assert "kl_adapters.demo.output" in edges["kl_adapters.demo.run"]
    assert "kl_adapters.demo.long_horizon_run" in edges["kl_adapters.cli"]
    assert "kl_adapters.demo.report" in edges["kl_adapters.demo.run"]
    # the facade attaches the loader to the switch; the loader's loads of the three adapters (computed names, read
    # from its ADAPTERS table) are edges like any other, and the switch imports no adapter
    assert {"kl_adapters.activation", "kl_adapters.adapters.loader"} <= set(edges["kl_adapters"])
    assert {"kl_adapters.adapters.trl", "kl_adapters.adapters.verl", "kl_adapters.adapters.openrlhf"} <= set(
        edges["kl_adapters.adapters.loader"])
    assert not [b for b in edges["kl_adapters.activation"] if layer(b) != "core"]
    assert "kl_adapters.reductions" in edges["kl_adapters.options"]  # options.py's one import is type-only
    # the demo's former circle (completions <-> harness: type-only one way, lazy the other) is gone
    assert "kl_adapters.demo.harness" not in edges["kl_adapters.demo.completions"]
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from importlib import import_module\nimport_module('.a', __name__)\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                                  "def f():\n    from .sub import c\n")
    (package / "b.py").write_text("import kl_adapters.a\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from .. import b\nfrom ..a import f\n")
    (package / "d.py").write_text("import importlib\nTABLE = {'x': 'kl_adapters.sub.c', 'y': 'sub.c'}\n"
                                  "def load(k):\n    return importlib.import_module(TABLE[k])\n")
    small = graph(tmp_path)
    assert small == {"kl_adapters": {"kl_adapters.a": 2}, "kl_adapters.a": {"kl_adapters.b": 3, "kl_adapters.sub.c": 5},
                     "kl_adapters.b": {"kl_adapters.a": 1}, "kl_adapters.d": {"kl_adapters.sub.c": 2},
                     "kl_adapters.sub": {}, "kl_adapters.sub.c": {"kl_adapters.b": 1, "kl_adapters.a": 2}}
    assert cycles(small) == [["kl_adapters.a", "kl_adapters.b", "kl_adapters.a"]]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert layer("kl_adapters.demo.task.driver") == "demo.task" and layer("kl_adapters.surrogate") == "core"
