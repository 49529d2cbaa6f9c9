"""The import graph of `jaxinfer/`: no cycles, and `metrics/` does not reach into `engine/`.

The graph is read from the source with `ast` (nothing is imported). Every import of a
`jaxinfer` module counts wherever it stands: at module level, inside a function, or under
`if TYPE_CHECKING:` (a type-only import runs nothing, but it still makes the module know the
one it names: a lower module that names a higher one's types is not below it).
`from pkg import name` is an edge to the submodule `pkg.name` when one exists, else to `pkg`
(its `__init__`); `import a.b.c` is an edge to `a.b.c`, and to the packages Python runs on
the way (`a`, `a.b`) that do not contain the importer (its own are already being run: counting
them would make every submodule a cycle with an `__init__` that re-exports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxinfer"


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (at any depth)."""
    files = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def nearest_module(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        # the package a relative import starts from: the module's own for an __init__
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.rsplit(".", node.level - 1)[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets += [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
        graph[module] = set()
        for target in filter(None, map(nearest_module, targets)):
            parts = target.split(".")
            parents = (".".join(parts[:i]) for i in range(1, len(parts)))
            graph[module] |= {target, *(p for p in parents if not within(module, p))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """For each strongly connected component of more than one module (or a module that
    imports itself): a shortest cycle through its first module, [a, b, ..., a]."""
    index, low, stack, components = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1 or v in graph[v]:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [shortest_cycle(graph, c) for c in components]


def shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """Breadth first from the component's first module back to itself, inside it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while True:  # a strongly connected component always leads back
        frontier_next = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    frontier_next.append(w)
        frontier = frontier_next


def test_no_import_cycles():
    found = cycles(import_graph(PACKAGE))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_metrics_do_not_import_engine():
    """The metrics read plain records (rows, `metrics.requests.FinishedRequest`), so anything
    can report them, and the engine reports through them."""
    graph = import_graph(PACKAGE)
    bad = sorted(
        (m, t)
        for m, targets in graph.items()
        if within(m, "jaxinfer.metrics")
        for t in targets
        if within(t, "jaxinfer.engine")
    )
    assert not bad, bad


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "sub").mkdir()
    (pkg / "sub" / "__init__.py").write_text("from .d import D\n")
    (pkg / "sub" / "d.py").write_text("from ..c import C\n")
    (pkg / "e.py").write_text("import pkg.sub.d\n")
    graph = import_graph(pkg)
    assert graph["pkg.c"] == {"pkg.a"}  # (not pkg: c is inside it)
    assert graph["pkg.sub.d"] == {"pkg.c"}
    assert graph["pkg.sub"] == {"pkg.sub.d"}
    assert graph["pkg.e"] == {"pkg.sub.d", "pkg.sub"}  # (pkg.sub's __init__ runs first)
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_kernels_stand_below_jaxinfer():
    """`pallas_kernels/` imports nothing from `jaxinfer/`: a kernel and its reference are
    usable alone, and what the kernels and the library both read (the KV page format of
    `paged_attention/fp8.py`, `reference.token_sequences`) lives with the kernels."""
    bad = []
    for path in sorted((PACKAGE.parent / "pallas_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [(path.name, n) for n in names if within(n, "jaxinfer")]
    assert not bad, bad
