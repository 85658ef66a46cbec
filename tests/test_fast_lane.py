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
