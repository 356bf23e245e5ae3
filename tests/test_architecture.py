"""The package's import graph: no cycle anywhere, and the router wing never imports the lab.

Every ``.py`` of ``smetric_lmc`` and of the folders installed as its sub-packages
(``controller/``, ``workers/``) is parsed (``ast``; nothing is imported). An import counts
wherever it is written: at module level, inside a function (a lazy import still ties the two
modules), under ``if TYPE_CHECKING:`` (the two still know each other), and as
``importlib.import_module("literal")``. Cycles are checked twice: between modules, and between
units, a unit being a sub-package (``smetric_lmc.lab.sim``) or a module directly in ``smetric_lmc``
(``smetric_lmc.config``), so two packages that import each other through different modules fail.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = "smetric_lmc"
#: The lab wing: research code that may import the router, never the reverse. One constant, so
#: that moving the lab under a sub-package changes this line only.
LAB: frozenset[str] = frozenset({"smetric_lmc.lab"})


def in_lab(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in LAB)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, name
    return Path(next(iter(spec.submodule_search_locations)))


def discover() -> dict[str, Path]:
    """Every module of the installed package (mapped folders included) -> its file."""
    modules: dict[str, Path] = {}
    pending = [ROOT]
    while pending:
        pkg = pending.pop()
        folder = _package_dir(pkg)
        modules[pkg] = folder / "__init__.py"
        for path in sorted(folder.iterdir()):
            if path.suffix == ".py" and path.stem != "__init__":
                modules[f"{pkg}.{path.stem}"] = path
            elif path.is_dir() and (path / "__init__.py").is_file():
                pending.append(f"{pkg}.{path.name}")
        # Sub-packages mapped from elsewhere (controller/, workers/) are not inside the folder.
        for mapped in ("controller", "workers"):
            name = f"{ROOT}.{mapped}"
            if pkg == ROOT and name not in pending and name not in modules:
                pending.append(name)
    return modules


def _imported_names(module: str, is_package: bool, tree: ast.Module) -> Iterator[str]:
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                source = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{a.name}" for a in node.names)  # `from pkg import module`
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out = set()
        for target in _imported_names(name, path.name == "__init__.py", tree):
            while target and target not in modules and "." in target:
                target = target.rpartition(".")[0]  # a name imported from a module: the module
            if target in modules and target != name:
                out.add(target)
        graph[name] = out
    return graph


def unit(module: str, modules: dict[str, Path]) -> str:
    """The innermost package holding ``module``; a module directly in the root is its own unit."""
    if modules[module].name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == ROOT else parent


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    modules = discover()
    return modules, import_graph(modules)


def test_the_walk_sees_every_wing_and_its_edges(graph: tuple[dict[str, Path], dict[str, set[str]]]) -> None:
    modules, edges = graph
    for name in ("smetric_lmc.controller.app", "smetric_lmc.workers.up", "smetric_lmc.index.tier",
                 "smetric_lmc.lab.sim.cluster", "smetric_lmc.config", *LAB):
        assert name in modules
    # Absolute, relative and lazy imports are all seen.
    assert "smetric_lmc.controller.membership" in edges["smetric_lmc.controller.app"]
    assert "smetric_lmc.controller.vllm_events" in edges["smetric_lmc.controller.app"]  # inside a function
    assert "smetric_lmc.lab.workload.model" in edges["smetric_lmc.lab.sim.cluster"]


def test_no_import_cycle_between_modules(graph: tuple[dict[str, Path], dict[str, set[str]]]) -> None:
    _, edges = graph
    assert cycles(edges) == []


def test_no_import_cycle_between_packages(graph: tuple[dict[str, Path], dict[str, set[str]]]) -> None:
    modules, edges = graph
    units: dict[str, set[str]] = {}
    for a, targets in edges.items():
        ua = unit(a, modules)
        units.setdefault(ua, set()).update(u for b in targets if (u := unit(b, modules)) != ua)
    assert cycles(units) == []


def test_the_router_never_imports_the_lab(graph: tuple[dict[str, Path], dict[str, set[str]]]) -> None:
    _, edges = graph
    wrong = sorted((a, b) for a, targets in edges.items() if not in_lab(a) for b in targets if in_lab(b))
    assert wrong == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_launcher_finds_the_mock_stack_by_entry_point() -> None:
    from smetric_lmc.lab.mock_engine.stack import bring_up_mock
    from smetric_lmc.workers.up import stack_plugin

    assert stack_plugin("mock") is bring_up_mock
    with pytest.raises(SystemExit, match="no 'nonesuch' engine stack installed"):
        stack_plugin("nonesuch")


def test_sim_report_writes_only_where_it_is_told(capsys: pytest.CaptureFixture[str]) -> None:
    from smetric_lmc.cli import main

    assert main(["sim", "report", "--trace", "nonesuch"]) == 2
    assert "needs --out FILE" in capsys.readouterr().out
