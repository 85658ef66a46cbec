"""No public function without a caller: every top-level public function of the packages
(``sat_jax``, ``train``, ``rollout_server``, ``rollout_api``) is named somewhere besides its own
``def``: called or imported in the code, the tests, the benchmarks or the examples, or named in
``pyproject.toml`` (an entry point) or a notebook. A name the scan finds nowhere else is dead code
(or reached only by a string the scan cannot see: then name it where it is used)."""

from __future__ import annotations

import ast
import collections
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("sat_jax", "train", "rollout_server", "rollout_api")
READERS = (*PACKAGES, "tests", "benchmarks", "examples")
_DOTTED = re.compile(r"[A-Za-z_][\w.:]*")


def names_used(tree: ast.AST) -> collections.Counter:
    """Every identifier a module reads: names, attributes, imported names and the parts of
    dotted strings (``"train.main:cli"``); definitions are not uses."""
    used = collections.Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used[node.id] += 1
        elif isinstance(node, ast.Attribute):
            used[node.attr] += 1
        elif isinstance(node, ast.alias):
            used[node.name.rsplit(".", 1)[-1]] += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _DOTTED.fullmatch(node.value):
                used.update(re.split(r"[.:]", node.value))
    return used


def public_functions(tree: ast.Module) -> list[str]:
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and not node.name.startswith("_")
    ]


def unused_functions(root: pathlib.Path) -> list[str]:
    """``path:name`` of every public top-level function of ``PACKAGES`` used nowhere."""
    used, defined = collections.Counter(), []
    for top in READERS:
        for path in sorted((root / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            used += names_used(tree)
            if top in PACKAGES:
                defined += [(path.relative_to(root), name) for name in public_functions(tree)]
    text = (root / "pyproject.toml").read_text()
    text += "".join(p.read_text() for p in (root / "notebooks").glob("*.ipynb"))
    return [
        f"{path}:{name}"
        for path, name in defined
        if not used[name] and not re.search(rf"\b{name}\b", text)
    ]


def test_the_scan_finds_a_function_nobody_calls(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\nx = "train.main:cli"\n')
    (tmp_path / "notebooks").mkdir()
    for top in READERS:
        (tmp_path / top).mkdir()
    (tmp_path / "train" / "main.py").write_text(
        "def cli(): pass\ndef used(): pass\ndef dead(): pass\ndef _private(): pass\n"
    )
    (tmp_path / "tests" / "test_x.py").write_text("from train.main import used\n")
    assert unused_functions(tmp_path) == ["train/main.py:dead"]


def test_every_public_function_has_a_caller():
    assert unused_functions(REPO) == []
