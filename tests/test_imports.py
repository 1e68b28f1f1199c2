"""Imports: every module of m2flow imports alone, in a fresh interpreter; the modules import
each other without a cycle; the actors' modules do not import torch."""

import ast
import json
import subprocess
import sys
import textwrap
from collections import deque
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


def _run(code: str, *args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    # From the repository root by default, so that `-c` imports this checkout's m2flow.
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


# -- each module alone, in a fresh interpreter ------------------------------------------
MISSING_DEPENDENCY = 3
# One interpreter loads the third-party packages the modules import (torch alone takes a
# second or more; transformers' model classes, which the LM modules reach through
# m2flow.models.lm, about three), then forks a child per module, two at a time: each child imports
# its module with no module of the package loaded before it, so an import that works only
# after another module of the package fails there as it would in a fresh interpreter.
PRELOAD = ("numpy", "torch", "omegaconf", "yaml", "rich.console", "gymnasium", "ray", "transformers",
           "transformers.modeling_utils", "transformers.models.auto")
_IMPORT_EACH = textwrap.dedent(f"""
    import importlib, json, os, sys, tempfile, traceback
    package, preloads, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    for preload in filter(None, preloads.split(",")):
        try:
            importlib.import_module(preload)
        except ImportError:
            pass
    assert not [m for m in sys.modules if m.partition(".")[0] == package], "the package was preloaded"

    def import_alone(name):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.partition(".")[0] == package:
                raise
            print(e.name)  # an optional dependency that is not installed
            return {MISSING_DEPENDENCY}
        return 0

    results, running, todo = {{}}, {{}}, list(names)
    while todo or running:
        while todo and len(running) < 2:
            name, out = todo.pop(0), tempfile.TemporaryFile(mode="w+")
            pid = os.fork()
            if pid == 0:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                try:
                    code = import_alone(name)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            running[pid] = name, out
        pid, status = os.wait()
        name, out = running.pop(pid)
        out.seek(0)
        results[name] = [os.waitstatus_to_exitcode(status), out.read()]
    print(json.dumps(results))
""")


def import_each_alone(package: str, names: list[str], cwd: Path, preload=PRELOAD) -> dict[str, tuple[int, str]]:
    """``{module: (exit code, its output)}`` for every module of ``names`` imported alone, after
    the third-party packages ``preload``."""
    done = _run(_IMPORT_EACH, package, ",".join(preload), *names, cwd=cwd, timeout=600)
    assert done.returncode == 0, done.stderr
    return {name: tuple(result) for name, result in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.fixture(scope="module")
def imported_alone() -> dict[str, tuple[int, str]]:
    return import_each_alone("m2flow", list(MODULES), ROOT)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_alone(imported_alone, name):
    code, output = imported_alone[name]
    if code == MISSING_DEPENDENCY:
        pytest.skip(f"{name} needs {output.strip()}, which is not installed")
    assert code == 0, f"import {name}, alone in a fresh interpreter, failed:\n{output}"


def test_import_alone_fails_a_module_that_needs_another_imported_first(tmp_path):
    """The check can fail: ``pkg.b`` uses ``pkg.a`` without importing it (it works only after
    ``pkg.a`` was imported); ``pkg.c`` needs a package that is not installed."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/a.py").write_text("X = 1\n")
    (tmp_path / "pkg/b.py").write_text("import pkg\n\nY = pkg.a.X\n")
    (tmp_path / "pkg/c.py").write_text("import no_such_package_anywhere\n")
    found = import_each_alone("pkg", ["pkg.a", "pkg.b", "pkg.c", "pkg"], tmp_path, preload=("numpy",))  # it needs no torch
    assert found["pkg.a"] == (0, "") and found["pkg"] == (0, "")
    assert found["pkg.b"][0] == 1 and "has no attribute 'a'" in found["pkg.b"][1]
    assert found["pkg.c"] == (MISSING_DEPENDENCY, "no_such_package_anywhere\n")


@pytest.mark.parametrize("name", ["m2flow.runtime.channel_actor", "m2flow.runtime.device_lock",
                                  "m2flow.runtime.worker", "m2flow.runtime.group", "m2flow.workers.tool"])
def test_actor_modules_do_not_import_torch(name):
    """A channel's or a device lock's actor process imports only its module: never torch,
    which would triple the actor's start-up time. Nor does a worker whose class needs no
    tensors (a tool worker's; the runtime imports torch where tensors are handled): 4
    such processes started in 2.1 s against 6.0 s with torch, on 2 cores."""
    done = _run(f"import {name}, sys; assert 'torch' not in sys.modules, 'torch was imported'")
    assert done.returncode == 0, done.stderr


def test_m2flow_status_imports_neither_torch_nor_ray(tmp_path):
    """A script may poll ``m2flow status`` often: it answers in a fraction of a second."""
    (tmp_path / "status.json").write_text('{"state": "finished", "pid": 1, "host": "h", "started": "s", '
                                          '"updated": "u", "unit": "step", "done": 2, "total": 2}')
    done = _run("import sys; from m2flow.cli import main; main(['status', sys.argv[1]]); "
                "heavy = {'torch', 'ray'} & set(sys.modules); assert not heavy, heavy", str(tmp_path))
    assert done.returncode == 0 and done.stdout.startswith(f"{tmp_path}: finished, 2 of 2 steps"), done


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
