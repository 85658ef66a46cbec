"""notebooks/explore_sat.ipynb runs top to bottom, and is committed without outputs.

The notebook runs in a fresh ipykernel of this interpreter (a kernelspec written to a temporary
JUPYTER_PATH, so no installed "python3" kernel of another environment is picked up), with its
working directory and TMPDIR in the test's tmp_path. It starts a rollout server itself; every
process the kernel starts carries a marker in its environment, and the test fails if one outlives
the run.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import tempfile
import time
import uuid

import nbclient
import nbformat
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "explore_sat.ipynb"
KERNEL_NAME = "sat-jax-notebook-test"
MARKER = "SAT_JAX_NOTEBOOK_TEST_RUN"
# Shared by runs of this test (the kernel and its server): a re-run skips most XLA compilation.
JAX_CACHE = pathlib.Path(tempfile.gettempdir()) / "sat_jax_notebook_test_jax_cache"
STRIP_HINT = (
    ".venv/bin/python -c \"import nbformat as n; p = 'notebooks/explore_sat.ipynb'; "
    "nb = n.read(p, 4); [c.update(outputs=[], execution_count=None) for c in nb.cells "
    "if c.cell_type == 'code']; [c.metadata.pop('execution', None) for c in nb.cells]; "
    'n.write(nb, p)"'
)


def _write_kernelspec(root: pathlib.Path) -> None:
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "sat-jax (test)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def _kernel_env(tmp_path: pathlib.Path, run_id: str) -> dict[str, str]:
    env = dict(os.environ)
    # tests/conftest.py simulates 8 CPU devices for the sharding tests; the notebook wants the
    # machine as a user has it. The inline backend (not a CI's Agg) renders the figures.
    env.pop("XLA_FLAGS", None)
    env.pop("MPLBACKEND", None)
    env.update(
        {
            MARKER: run_id,
            "TMPDIR": str(tmp_path),
            "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(JAX_CACHE),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
    )
    return env


def _marked_processes(run_id: str) -> list[int]:
    """Live processes (other than this one) whose environment holds ``MARKER=run_id``."""
    needle = f"{MARKER}={run_id}".encode()
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _wait_for_no_marked_processes(run_id: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _marked_processes(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    jupyter_dir = tmp_path / "jupyter"
    _write_kernelspec(jupyter_dir)
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_dir))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_id = uuid.uuid4().hex
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=600,
        resources={"metadata": {"path": str(run_dir)}},
    )
    start = time.monotonic()
    try:
        client.execute(env=_kernel_env(run_dir, run_id))  # raises CellExecutionError on a failure
    finally:
        # The executed copy (with outputs and the failing cell's traceback) for a look afterwards.
        nbformat.write(nb, tmp_path / "explore_sat.executed.ipynb")
        left = _wait_for_no_marked_processes(run_id, timeout_s=30)
        for pid in left:  # do not leak them into the rest of the session
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elapsed = time.monotonic() - start
    assert not left, f"processes started by the notebook outlived it: {left}"

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(figures) >= 2, "the notebook's figures were not rendered"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "server stopped (exit code 0)" in text
    print(f"notebook executed in {elapsed:.0f}s")


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        and (c.outputs or c.execution_count is not None or "execution" in c.metadata)
    ]
    assert not dirty, (
        f"cells {dirty} carry outputs or execution counts; strip them with\n{STRIP_HINT}"
    )
