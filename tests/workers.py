"""Child Python processes for the multi-process tests: started together, always reaped."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def cpu_env(xla_flags: str) -> dict[str, str]:
    """This environment on the CPU backend with ``xla_flags`` and the checkout importable."""
    return {
        **os.environ,
        "XLA_FLAGS": xla_flags,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def run_all(script: pathlib.Path, jobs: list[tuple[list[str], dict[str, str]]], timeout_s: float):
    """Starts ``python script *args`` for every ``(args, env)`` job, waits for all (each bounded
    by ``timeout_s``), kills whatever is left, and fails the test unless every one exits 0."""
    procs = []
    try:
        for args, env in jobs:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        for p in procs:
            try:
                log = p.communicate(timeout=timeout_s)[0]
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {p.args} timed out after {timeout_s}s")
            assert p.returncode == 0, f"worker {p.args} failed (rc={p.returncode}):\n{log[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
