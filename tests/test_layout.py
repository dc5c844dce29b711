"""The package's layout: no import cycles between modules, and no import from a higher floor.

Every module of ``relaxgrad`` is parsed (not imported) and every import in it counts: at any
depth (function-local ones, those under ``try`` or ``if TYPE_CHECKING``), relative or absolute.
``from P import n`` imports ``P.n`` when that is a module, else ``P``; importing a module of
another package also imports that package's ``__init__`` (Python runs it first), so that edge
counts too.

A *room* is a top-level module or subpackage of ``relaxgrad`` (``relaxgrad`` itself is the
package's ``__init__``). :data:`FLOORS` gives each room a floor; a module may import only
rooms on its own floor or below. Rooms that share a floor may import each other, module
cycles aside.
"""

import ast
from pathlib import Path

import pytest

#: room -> floor. Leaves (no relaxgrad import) are on floor 0; each room imports only
#: rooms on its floor or below. A new top-level module or subpackage needs a row here.
FLOORS = {
    # leaves: TVM's type API, errors, process setup, the version
    "_threads": 0,
    "_stack": 0,
    "_ty": 0,
    "_tir": 0,
    "_version": 0,
    "errors": 0,
    # plumbing over the leaves: the expression walker, module updates, the compile cache
    "exprs": 1,
    "_module": 1,
    "cache": 1,
    # a function as plain data; the gradient rules; the TIR schedules
    "program": 2,
    "ops": 2,
    "schedules": 2,
    # memory models over programs and compiled modules
    "analysis": 3,
    # the passes
    "transforms": 4,
    # compiling; numeric gradient checks
    "pipeline": 5,
    "testing": 5,
    # training (its runtime-only runner included)
    "training": 6,
    # entry points: the command line and the package's public face
    "cli": 7,
    "relaxgrad": 7,
    # the README's example, written against the public face
    "example": 8,
}

PACKAGE = "relaxgrad"


#: this checkout's package (read as text, whichever ``relaxgrad`` Python would import)
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict) -> set[str]:
    """The package's modules that module ``name`` (at ``path``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                child = f"{source}.{alias.name}"
                targets.add(child if child in modules else source)
    edges = set()
    for target in targets:
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            continue
        while target not in modules:  # ``import relaxgrad.x.y`` of a name: the module part
            target = target.rpartition(".")[0]
        edges.add(target)
        parent = target.rpartition(".")[0]
        while parent and not (name == parent or name.startswith(parent + ".")):
            edges.add(parent)  # another package's ``__init__`` runs first
            parent = parent.rpartition(".")[0]
    edges.discard(name)
    return edges


def _graph(root: Path) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of several modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)

    for root in sorted(graph):
        if root in index:
            continue
        visit(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            u, children = work[-1]
            for w in children:
                if w not in index:
                    visit(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[u] = min(low[u], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[u])
                if low[u] == index[u]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == u:
                            break
                    if len(component) > 1:
                        components.append(component)
    return components


def _shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """A shortest cycle through ``start`` inside ``within`` (first module repeated last)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        closing = [v for v in frontier if start in graph[v]]
        if closing:
            return paths[closing[0]] + [start]
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & within):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle in {sorted(within)}")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles: for each module on one, a shortest cycle through it (each cycle once,
    starting at its least module; first module repeated last)."""
    cycles = []
    for component in _components(graph):
        for module in sorted(component):
            cycle = _shortest_cycle(graph, module, component)[:-1]
            first = cycle.index(min(cycle))
            cycle = cycle[first:] + cycle[:first]
            if cycle + cycle[:1] not in cycles:
                cycles.append(cycle + cycle[:1])
    return cycles


def _upward(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """The imports of a room on a higher floor than the importer's, described."""
    return sorted(
        f"{module} (floor {floors[_room(module)]}) imports {target} "
        f"(floor {floors[_room(target)]})"
        for module, targets in graph.items() for target in targets
        if _room(module) in floors and _room(target) in floors
        and floors[_room(target)] > floors[_room(module)]
    )


@pytest.fixture(scope="module")
def graph():
    return _graph(ROOT)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Relative, absolute, function-local and ``from package import module`` imports count,
    and importing a module of another package imports that package too."""
    root = tmp_path / PACKAGE
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("from .a import f\n")
    (root / "a.py").write_text("def f():\n    from .sub import b\n    import relaxgrad.c\n")
    (root / "c.py").write_text("try:\n    from relaxgrad.sub.b import g\nexcept ImportError:\n"
                               "    from b import g\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "b.py").write_text("from .. import a\nfrom . import missing_name\n")
    graph = _graph(root)
    assert graph == {
        "relaxgrad": {"relaxgrad.a"},
        "relaxgrad.a": {"relaxgrad.sub.b", "relaxgrad.sub", "relaxgrad.c"},
        "relaxgrad.c": {"relaxgrad.sub.b", "relaxgrad.sub"},
        "relaxgrad.sub": set(),
        "relaxgrad.sub.b": {"relaxgrad.a", "relaxgrad.sub"},
    }
    assert _cycles(graph) == [
        ["relaxgrad.a", "relaxgrad.sub.b", "relaxgrad.a"],
        ["relaxgrad.a", "relaxgrad.c", "relaxgrad.sub.b", "relaxgrad.a"],
    ]
    floors = {"relaxgrad": 3, "a": 2, "c": 2, "sub": 1}
    assert _upward(graph, floors) == [
        "relaxgrad.sub.b (floor 1) imports relaxgrad.a (floor 2)",
    ]


def test_no_import_cycles(graph):
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_room_has_a_floor(graph):
    rooms = {_room(m) for m in graph}
    assert rooms <= set(FLOORS), f"rooms without a floor in FLOORS: {sorted(rooms - set(FLOORS))}"


def test_no_upward_imports(graph):
    upward = _upward(graph, FLOORS)
    assert not upward, "upward imports:\n" + "\n".join(upward)
