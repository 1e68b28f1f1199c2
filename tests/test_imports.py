"""Imports: every module of m2flow imports alone, in a fresh interpreter; the modules import
each other without a cycle; the actors' modules do not import torch."""

import ast
import subprocess
import sys
import textwrap
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def package_modules(package: Path) -> dict[str, Path]:
    """Every module of the package in folder ``package``: dotted name -> file."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = package_modules(ROOT / "m2flow")


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    # From the repository root, so that `-c` imports this checkout's m2flow.
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


# -- each module alone, in a fresh interpreter ------------------------------------------
MISSING_DEPENDENCY = 3
_IMPORT_ALONE = textwrap.dedent(f"""
    import importlib, sys
    try:
        importlib.import_module(sys.argv[1])
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] == "m2flow":
            raise
        print(e.name)  # an optional dependency that is not installed
        sys.exit({MISSING_DEPENDENCY})
""")


@pytest.fixture(scope="module")
def imported_alone() -> dict[str, subprocess.CompletedProcess]:
    """Every module imported in an interpreter of its own, two at a time (a few seconds
    each: torch, transformers)."""
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(MODULES, pool.map(lambda name: _run(_IMPORT_ALONE, name), MODULES)))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_alone(imported_alone, name):
    done = imported_alone[name]
    if done.returncode == MISSING_DEPENDENCY:
        pytest.skip(f"{name} needs {done.stdout.strip()}, which is not installed")
    assert done.returncode == 0, f"import {name}, alone in a fresh interpreter, failed:\n{done.stderr}"


@pytest.mark.parametrize("name", ["m2flow.runtime.channel_actor", "m2flow.runtime.device_lock"])
def test_actor_modules_do_not_import_torch(name):
    """A channel's or a device lock's actor process imports only its module: never torch,
    which would triple the actor's start-up time."""
    done = _run(f"import {name}, sys; assert 'torch' not in sys.modules, 'torch was imported'")
    assert done.returncode == 0, done.stderr


# -- the module graph -------------------------------------------------------------------
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement, at module level or inside functions and classes, except
    those under ``if TYPE_CHECKING:`` (never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo += ast.iter_child_nodes(node)


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module of ``modules`` it imports: line of the first such import}.

    ``from p import x`` is an edge to the module ``p.x`` if there is one, else to ``p``
    (``x`` is a name in it). Importing ``p.x`` also runs the package ``p``, but that is no
    edge: a package's ``__init__`` may import its modules, which import each other by
    their full names."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph[name] = {}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The sets of modules that import one another, directly or not (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def shortest_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, in import order, that module
    at both ends (breadth first)."""
    start = min(component)
    came_from = {start: None}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w in component and w not in came_from:
                came_from[w] = v
                todo.append(w)
    raise AssertionError(f"no cycle through {start}")


def describe(graph: dict[str, dict[str, int]], component: set[str]) -> str:
    cycle = shortest_cycle(graph, component)
    steps = " -> ".join([cycle[0]] + [f"{b} (line {graph[a][b]} of {a})" for a, b in zip(cycle, cycle[1:])])
    return f"{', '.join(sorted(component))} import one another: {steps}"


def test_no_import_cycle():
    graph = import_graph(MODULES)
    cycles = [describe(graph, c) for c in import_cycles(graph)]
    assert not cycles, "import cycles (imports inside functions count too):\n" + "\n".join(cycles)


def test_cycle_check_names_a_planted_cycle(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from pkg import b\n\nA = 1\n",
        "pkg/b.py": "def f():\n    from pkg.c import C\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nfrom .a import A\nC = A\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        "pkg/e.py": "import pkg.d\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(package_modules(tmp_path / "pkg"))
    assert graph["pkg"] == {"pkg.a": 1} and graph["pkg.c"] == {"pkg.a": 4}
    # The function-local import closes the cycle; the TYPE_CHECKING one (d <-> e) does not count.
    cycles = import_cycles(graph)
    assert cycles == [{"pkg.a", "pkg.b", "pkg.c"}]
    assert describe(graph, cycles[0]) == ("pkg.a, pkg.b, pkg.c import one another: pkg.a -> pkg.b (line 1 of pkg.a) "
                                          "-> pkg.c (line 2 of pkg.b) -> pkg.a (line 4 of pkg.c)")
