"""Prose that names files stays true.

Every package map names exactly the modules on disk: a package whose docstring lists its modules
("- ``name``, ``other``: what they do" lines) lists each of its modules and subpackages once, and
none that is gone (``__init__`` and ``__main__`` aside). Every ``.py`` path README.md and
docs/DESIGN.md quote is a file."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# The packages whose docstrings map their modules.
MAPPED = [
    "train",
    "rollout_server",
    "rollout_api",
    "sat_jax/objectives",
    "sat_jax/plan",
    "sat_jax/step",
]
_NAME = re.compile(r"`+([A-Za-z_][A-Za-z0-9_]*)`+")


def map_names(docstring: str) -> set[str]:
    """The modules a docstring's map names: the quoted names before the first ": " of every line
    that starts with "- "."""
    names = set()
    for line in docstring.splitlines():
        if line.startswith("- "):
            names |= set(_NAME.findall(line[2:].split(": ", 1)[0]))
    return names


def modules_on_disk(package: pathlib.Path) -> set[str]:
    """A package's modules and subpackages, without ``__init__`` and ``__main__``."""
    modules = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    return modules | {p.parent.name for p in package.glob("*/__init__.py")}


def test_map_names_reads_the_names_before_the_colon():
    doc = (
        "Intro `x`.\n\n- ``a``, ``b``: they do `c`.\n- `d`: more\n  - `e`: indented, not a map line"
    )
    assert map_names(doc) == {"a", "b", "d"}


@pytest.mark.parametrize("package", MAPPED)
def test_the_package_map_names_the_modules_on_disk(package):
    path = REPO / package
    doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or ""
    named, disk = map_names(doc), modules_on_disk(path)
    assert named, f"{package}/__init__.py has no module map"
    assert not named - disk, f"{package}'s map names modules that are gone: {sorted(named - disk)}"
    assert not disk - named, f"{package}'s map omits {sorted(disk - named)}"


@pytest.mark.parametrize("doc", ["README.md", "docs/DESIGN.md"])
def test_the_python_files_the_docs_name_exist(doc):
    text = (REPO / doc).read_text()
    named = set(
        re.findall(
            r"`((?:sat_jax|train|rollout_server|rollout_api|tests|benchmarks)/[\w/]+\.py)`", text
        )
    )
    assert named, doc
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"{doc} names files that are gone: {missing}"
