"""The import graph of the project's packages, read from their source (docs/DESIGN.md §1).

Counts every import statement wherever it sits (module level, inside functions, under
``TYPE_CHECKING``) and the package ``__init__`` modules an import runs on the way to its target
(except the importer's own ancestors, which Python is already running). Checks that the graph
has no cycle and that the floors point one way.
"""

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("rollout_api", "sat_jax", "rollout_server", "train")
# Floor by floor: what each package may import of the others (docs/DESIGN.md §1).
ALLOWED = {
    "rollout_api": set(),
    "sat_jax": set(),
    "rollout_server": {"rollout_api", "sat_jax"},
    "train": {"rollout_api", "sat_jax"},
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules its source imports (see the module docstring)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = collections.defaultdict(set)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in mods else resolve(base))
        own = set(_ancestors(mod))
        for target in filter(None, targets):
            for dep in [*_ancestors(target), target]:
                if dep != mod and dep not in own and dep in mods:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_floors_point_one_way(package):
    wrong = sorted(
        (mod, dep)
        for mod, deps in import_graph().items()
        if mod.split(".")[0] == package
        for dep in deps
        if dep.split(".")[0] not in {package, *ALLOWED[package]}
    )
    assert wrong == [], f"{package} imports a package above or beside it"


def test_rules_do_not_import_the_model():
    graph = import_graph()
    for mod in ("sat_jax.parallel.rules", "sat_jax.parallel"):
        assert not {d for d in graph.get(mod, ()) if d.startswith("sat_jax.model")}, mod
