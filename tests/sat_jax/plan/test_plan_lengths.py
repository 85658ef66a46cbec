"""``python -m sat_jax.plan --lengths``: padded against packed batches of a length distribution.

The report has a row per batch layout (padded, packed) with its padded fraction and FLOPs per
useful token; the compile tests (``--compile`` on this host, ``--topology`` with libtpu, in a
subprocess as a user runs it) add the per-device memory of each compiled step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from sat_jax.plan import lengths, topology
from sat_jax.plan.__main__ import main as plan_main

from .test_plan_tpu import REPO

ROW_RE = re.compile(
    r"^(padded|packed)\s+(\d+) x (\d+)\s+(\d+)\s+([\d.]+)\s+(\S+)\s+(\S+)\s+(\S+)$", re.M
)
TINY = ("--preset", "tiny", "--mesh", "fsdp=1", "--batch", "64", "--seq-len", "256")


def _rows(stdout: str) -> dict[str, dict[str, float | str]]:
    rows = {}
    for name, r, t, k, pad, flops, per_token, memory in ROW_RE.findall(stdout):
        rows[name] = {
            "rows": int(r),
            "length": int(t),
            "k": int(k),
            "pad_frac": float(pad),
            "flops": float(flops),
            "per_token": float(per_token),
            "memory": memory,
        }
    return rows


def _check_rows(stdout: str, memory: bool) -> dict[str, dict[str, float | str]]:
    rows = _rows(stdout)
    assert set(rows) == {"padded", "packed"}, stdout
    padded, packed = rows["padded"], rows["packed"]
    assert packed["pad_frac"] < padded["pad_frac"], stdout
    assert packed["per_token"] < padded["per_token"], stdout
    assert packed["rows"] * packed["length"] < padded["rows"] * padded["length"]
    for row in rows.values():
        assert (row["memory"] != "-") == memory, stdout
    return rows


def test_the_report_has_a_padded_and_a_packed_row(capsys) -> None:
    assert plan_main([*TINY, "--lengths", "lognormal:median=40"]) == 0
    out = capsys.readouterr().out
    assert "lengths          lognormal:median=40: 64 trajectories" in out
    rows = _check_rows(out, memory=False)
    assert rows["padded"]["rows"] == 64 and rows["padded"]["length"] == 256  # 5% at the cap


def test_lengths_from_a_file(tmp_path, capsys) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("10 20\n30 250 5\n")
    assert plan_main([*TINY, "--lengths", str(path)]) == 0
    rows = _check_rows(capsys.readouterr().out, memory=False)
    assert rows["padded"]["rows"] == 64
    drawn = lengths.draw(str(path), 7, 256)
    np.testing.assert_array_equal(drawn, [10, 20, 30, 250, 5, 10, 20])  # cycled


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gamma", "neither a file nor one of"),
        ("lognormal:mean=3", "settings are"),
        ("lognormal:median", "settings are"),
    ],
)
def test_bad_distributions_are_clear_errors(spec: str, message: str, capsys) -> None:
    assert plan_main([*TINY, "--lengths", spec]) == 2
    assert message in capsys.readouterr().err


def test_a_file_length_over_the_capacity_is_an_error(tmp_path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("10 300")
    with pytest.raises(ValueError, match=r"in \[1, 256\]"):
        lengths.draw(str(path), 4, 256)


def test_named_lognormal_has_its_cut_at_the_cap() -> None:
    drawn = lengths.draw("lognormal:median=300,sigma=1,cut=0.1", 200, 2048, seed=3)
    assert (drawn == 2048).sum() >= 20 and drawn.min() >= 2 and drawn.max() == 2048
    assert 200 < np.median(drawn) < 450


def test_a_token_budget_splits_both_batches() -> None:
    """``train.microbatch_tokens``: the padded batch into rows · T / budget microbatches, the
    packed one into the fewest that fit the budget; rows a multiple of the data shards."""
    drawn = lengths.draw("lognormal", 512, 8704)
    padded, packed = lengths.batch_shapes(
        drawn,
        capacity=8704,
        length_bucket=64,
        row_tokens=0,
        microbatches=1,
        row_multiple=64,
        microbatch_tokens=32 * 8704,
    )
    assert (padded.rows, padded.length, padded.microbatches) == (512, 8704, 16)
    assert packed.rows % 64 == 0 and packed.length == 8704
    assert packed.rows * packed.length // packed.microbatches <= 32 * 8704
    assert packed.microbatches < padded.microbatches and packed.view == (512, 8704)
    assert packed.pad_frac < padded.pad_frac


def _plan(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "sat_jax.plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


@pytest.mark.slow
def test_compiled_on_this_host_each_row_has_its_memory() -> None:
    res = _plan(
        "--preset", "tiny", "--mesh", "fsdp=1", "--batch", "16", "--seq-len", "64",
        "--compile", "--lengths", "lognormal:median=12",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    _check_rows(res.stdout, memory=True)


@pytest.mark.slow
@pytest.mark.skipif(not topology.libtpu_installed(), reason="libtpu is not installed")
def test_compiled_for_a_v5p_slice_each_row_has_its_memory() -> None:
    res = _plan(
        "--preset", "tiny", "--mesh", "fsdp=4", "--topology", "v5p:2x2x1", "--compile",
        "--batch", "32", "--seq-len", "128", "--lengths", "lognormal:median=30", "remat=layer",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _check_rows(res.stdout, memory=True)
    assert rows["packed"]["rows"] % 4 == 0  # the 4 data shards
