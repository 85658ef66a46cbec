"""`make test-fast` leaves out the tests of tests/conftest.py's HEAVY_TESTS: each entry must name a
test function that exists, or a renamed test would silently join the fast lane again."""

import ast
import pathlib

from tests.conftest import HEAVY_TESTS

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_every_heavy_test_exists():
    missing = []
    for path, names in HEAVY_TESTS.items():
        source = REPO / path
        defined = set()
        if source.is_file():
            tree = ast.parse(source.read_text())
            defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        missing += [f"{path}::{name}" for name in names if name not in defined]
    assert not missing, f"HEAVY_TESTS names tests that do not exist: {missing}"


def test_no_file_is_listed_twice():
    """A file listed twice in the dict literal keeps only its last list: the first list's tests
    would silently join the fast lane."""
    tree = ast.parse((REPO / "tests" / "conftest.py").read_text())
    [heavy] = [
        n.value
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "HEAVY_TESTS"
    ]
    keys = [k.value for k in heavy.keys]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
