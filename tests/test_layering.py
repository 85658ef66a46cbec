"""The import graph of the project's packages, read from their source (docs/DESIGN.md §1).

Counts every import statement wherever it sits (module level, inside functions, under
``TYPE_CHECKING``) and the package ``__init__`` modules an import runs on the way to its target
(except the importer's own ancestors, which Python is already running), so an import moved into a
function to dodge a cycle still closes it here. Checks that the graph has no cycle, neither between
modules nor between the floors inside ``sat_jax/``, and that the floors point one way.
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


# The floors inside sat_jax/, lowest first: each unit (a top-level module or subpackage) may import
# only units of its own floor or below (docs/DESIGN.md §1). A unit not listed is an error.
SAT_JAX_FLOORS = (
    {
        "sat_jax",
        "sat_jax.sharding",
        "sat_jax.packing",
        "sat_jax.cpu_clock",
        "sat_jax.quant",
        "sat_jax.json_mask",
        "sat_jax.json_automaton",
    },
    {"sat_jax.model"},
    {
        "sat_jax.objectives",
        "sat_jax.tasks",
        "sat_jax.optimizer",
        "sat_jax.params_io",
        "sat_jax.config",
    },
    {"sat_jax.experiment", "sat_jax.decoding", "sat_jax.completions", "sat_jax.cli"},
    {"sat_jax.step"},
    {"sat_jax.plan"},
)


class Source:
    """One module's source text and whether it is a package's ``__init__``."""

    def __init__(self, text: str, is_package: bool = False):
        self.text, self.is_package = text, is_package


def _modules() -> dict[str, Source]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = Source(
                path.read_text(), path.name == "__init__.py"
            )
    return mods


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(mods: dict[str, Source] | None = None) -> dict[str, set[str]]:
    """module -> the modules of ``mods`` (default: the project's) its source imports (see the
    module docstring)."""
    mods = _modules() if mods is None else mods

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = collections.defaultdict(set)
    for mod, source in mods.items():
        is_pkg = source.is_package
        targets = []
        for node in ast.walk(ast.parse(source.text, mod)):
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


def unit_graph(graph: dict[str, set[str]], package: str = "sat_jax") -> dict[str, set[str]]:
    """The graph of ``package``'s units (its top-level modules and subpackages, ``package.x``),
    an edge wherever a module of one imports a module of another."""

    def unit(mod: str) -> str:
        return ".".join(mod.split(".")[:2])

    units: dict[str, set[str]] = collections.defaultdict(set)
    for mod, deps in graph.items():
        if mod.split(".")[0] != package:
            continue
        for dep in deps:
            if dep.split(".")[0] == package and unit(dep) != unit(mod):
                units[unit(mod)].add(unit(dep))
    return units


def _floor(unit: str) -> int:
    return next(i for i, floor in enumerate(SAT_JAX_FLOORS) if unit in floor)


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_cycle_between_the_floors_of_sat_jax():
    assert cycles(unit_graph(import_graph())) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# A package whose model dodges a cycle with an import inside a function, as sat_jax.model.hf once
# imported the parameter shardings (which import the model) inside its loaders.
DODGED = {
    "pkg": Source("", is_package=True),
    "pkg.rules": Source("import math\n"),
    "pkg.model": Source("from pkg import rules\n\n\ndef load():\n    from pkg import shardings\n"),
    "pkg.shardings": Source("from pkg.model import load\n"),
}


def test_an_import_inside_a_function_that_closes_a_cycle_is_flagged():
    graph = import_graph(DODGED)
    assert graph["pkg.model"] == {"pkg.rules", "pkg.shardings"}
    assert cycles(graph) == [["pkg.model", "pkg.shardings"]]
    assert cycles(unit_graph(graph, "pkg")) == [["pkg.model", "pkg.shardings"]]


def test_an_import_inside_a_function_is_fine_without_a_cycle():
    fine = {**DODGED, "pkg.shardings": Source("from pkg import rules\n")}
    assert cycles(import_graph(fine)) == []


def test_every_unit_of_sat_jax_has_a_floor():
    units = {".".join(m.split(".")[:2]) for m in _modules() if m.startswith("sat_jax")}
    assert units <= set().union(*SAT_JAX_FLOORS)


def test_the_floors_of_sat_jax_point_down():
    wrong = sorted(
        (unit, dep)
        for unit, deps in unit_graph(import_graph()).items()
        for dep in deps
        if _floor(dep) > _floor(unit)
    )
    assert wrong == [], "a unit of sat_jax imports one on a floor above it"


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


def test_sharding_rules_import_nothing_of_sat_jax():
    assert not {d for d in import_graph().get("sat_jax.sharding", ()) if d != "sat_jax"}


# The command modules of sat_jax/, whose entry functions alone may read the command line and the
# process environment (docs/DESIGN.md §1): the library takes both as arguments.
ENTRY_POINTS = {"sat_jax.plan.__main__"}
_PROCESS_STATE = {("sys", "argv"), ("os", "environ"), ("os", "getenv"), ("os", "putenv")}


def reads_process_state(source: Source) -> list[str]:
    """The ``sys.argv`` / ``os.environ`` / ``os.getenv`` uses in ``source``, sorted."""
    return sorted(
        f"{node.value.id}.{node.attr}"
        for node in ast.walk(ast.parse(source.text))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and (node.value.id, node.attr) in _PROCESS_STATE
    )


def test_only_entry_points_of_sat_jax_read_argv_and_the_environment():
    wrong = {
        mod: reads_process_state(source)
        for mod, source in _modules().items()
        if mod.startswith("sat_jax") and mod not in ENTRY_POINTS
    }
    assert {mod: uses for mod, uses in wrong.items() if uses} == {}


def test_a_library_read_of_the_environment_is_found():
    source = Source("import os\n\n\ndef f():\n    return os.environ.get('X'), os.getenv('Y')\n")
    assert reads_process_state(source) == ["os.environ", "os.getenv"]


def test_every_folder_of_a_package_is_a_regular_package():
    """setuptools' ``find_packages`` (pyproject) skips a folder without ``__init__.py``."""
    folders = {p.parent for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert (
        sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []
    )
