"""Plans for TPU slices: the train step and the server's programs compiled with XLA:TPU here.

The compile tests run ``python -m sat_jax.plan --topology ...`` as a user does, in a subprocess
(libtpu then loads in that process only). They need libtpu (the ``test`` extra installs it):
without it they skip; with libtpu installed but not loading they fail and say so. The rest checks
the accounting and parsing without libtpu.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from sat_jax.plan import memory as plan
from sat_jax.plan import topology
from sat_jax.plan.__main__ import main as plan_main

REPO = pathlib.Path(__file__).resolve().parents[3]
GIB = 2**30
LIBTPU = topology.libtpu_installed()
needs_libtpu = pytest.mark.skipif(
    not LIBTPU, reason="libtpu is not installed (pip install -e '.[test]' brings it)"
)
TOTAL_RE = re.compile(
    r"^per-device total: (>?[\d.]+) GiB of ([\d.]+) GiB HBM: (fits|does not fit)$", re.M
)


def _plan(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        # Not tests/conftest.py's persistent compilation cache: these tests assert what XLA:TPU
        # says compiling for a slice this machine does not have, so it compiles every time.
        "JAX_COMPILATION_CACHE_DIR": "",
    }
    res = subprocess.run(
        [sys.executable, "-m", "sat_jax.plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if "libtpu is installed but" in res.stderr:
        pytest.fail(f"libtpu is installed but will not load here:\n{res.stderr[-2000:]}")
    return res


def _total(stdout: str) -> tuple[str, float, str]:
    match = TOTAL_RE.search(stdout)
    assert match, stdout
    return match.group(1), float(match.group(2)), match.group(3)


TINY_TRAIN = (
    "--preset", "tiny", "--mesh", "fsdp=4", "--topology", "v5p:2x2x1", "--compile",
    "--batch", "8", "--seq-len", "64", "remat=layer",
)  # fmt: skip


@pytest.mark.slow
@needs_libtpu
def test_train_step_compiles_for_a_v5p_slice_and_fits() -> None:
    res = _plan(*TINY_TRAIN)
    assert res.returncode == 0, res.stderr[-3000:]
    used, hbm, word = _total(res.stdout)
    assert word == "fits" and hbm == 95.0 and 0 < float(used) < 1
    assert "4 x TPU v5 (v5p)" in res.stdout
    ratio = float(re.search(r"^compiled/analytic FLOPs: ([\d.]+)$", res.stdout, re.M).group(1))
    design = float(re.search(r"^by design\s+([\d.]+)", res.stdout, re.M).group(1))
    # remat=layer: 4/3 by design. Counted with each loop once (XLA's cost_analysis) it would be
    # below that (two scanned layers count as one); even every matmul run over all E = 8 experts
    # instead of the K = 2 chosen would stay below design · E / K.
    assert design == pytest.approx(4 / 3, abs=1e-3)
    assert design <= ratio < design * 8 / 2, res.stdout
    # The same program against a tiny HBM: the same total, and the verdict flips with status 1.
    small = _plan(*TINY_TRAIN, "--hbm-gib", "0.001")
    assert small.returncode == 1, small.stderr[-3000:]
    assert _total(small.stdout) == (used, 0.001, "does not fit")


@pytest.mark.slow
@needs_libtpu
def test_a_batch_the_compiler_refuses_does_not_fit() -> None:
    # 16 GiB v5e chips; a batch whose activations XLA:TPU cannot place in them.
    res = _plan(
        "--preset", "tiny", "--mesh", "fsdp=4", "--topology", "v5e:2x2", "--compile",
        "--batch", "4096", "--seq-len", "4096", "max_seq_len=4096",
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    assert "XLA:TPU refused the program: RESOURCE_EXHAUSTED" in res.stdout
    used, hbm, word = _total(res.stdout)
    assert word == "does not fit" and hbm == 16.0 and float(used) > 15


@pytest.mark.slow
@needs_libtpu
def test_server_programs_compile_for_a_v5p_slice(tmp_path) -> None:
    """The server's programs fit, and its decode step, traced under the server's mesh, runs the
    experts in the trainer's megablox kernel (a Pallas call per MoE layer), not ragged_dot."""
    hlo = tmp_path / "generate.hlo"
    res = _plan(
        "--config", str(REPO / "configs" / "arith_tiny.yaml"), "--topology", "v5p:2x2x1",
        "--serve", "server.mesh.fsdp=4", "server.slots=8", "--dump-hlo", str(hlo),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert _total(res.stdout)[2] == "fits"
    for label in ("prefill", "insert", "generate[25]", "KV cache", "per token", "roofline"):
        assert re.search(rf"^\s*{re.escape(label)}\s", res.stdout, re.M), (label, res.stdout)
    text = hlo.read_text()
    assert "jit(gmm)/pallas_call" in text
    assert "ragged" not in text


def test_a_topology_without_libtpu_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(topology, "libtpu_installed", lambda library_path="": False)
    assert plan_main([*TINY_TRAIN]) == 2
    assert "libtpu is not installed" in capsys.readouterr().err


def test_the_offline_libtpu_environment_names_the_slice() -> None:
    env = topology.offline_libtpu_env("v5p:4x4x4")
    assert env["TPU_ACCELERATOR_TYPE"] == "v5p-128"
    assert topology.offline_libtpu_env("v5e:4x4")["TPU_ACCELERATOR_TYPE"] == "v5litepod-16"
    assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1" and env["TPU_SKIP_MDS_QUERY"] == "1"


@pytest.mark.parametrize(
    ("name", "want"),
    [("v5p:4x4x4", ("v5p", (4, 4, 4))), ("v6e:4x8", ("v6e", (4, 8))), ("v5e:2x2", ("v5e", (2, 2)))],
)
def test_topology_names(name, want) -> None:
    assert topology.parse_topology(name) == want


@pytest.mark.parametrize("name", ["v5p-64", "v7:2x2", "v5p:4x4x4x4", "v5p:0x4x4", ""])
def test_bad_topology_names(name) -> None:
    with pytest.raises(ValueError, match="topology"):
        topology.parse_topology(name)


def test_verdict_is_fits_up_to_the_hbm_and_not_a_byte_more() -> None:
    hbm = topology.CHIPS["TPU v5"].hbm_bytes
    assert plan.verdict(hbm, hbm) == "per-device total: 95.000 GiB of 95.000 GiB HBM: fits"
    assert plan.verdict(hbm + 1, hbm).endswith(": does not fit")
    assert topology.CHIPS["TPU v5 lite"].hbm_bytes == 16 * GIB


def test_donated_buffers_count_once() -> None:
    mem = topology.ProgramMemory(argument=100, output=70, alias=60, temp=5, code=1)
    assert mem.total == 100 + 70 - 60 + 5 + 1


@pytest.mark.parametrize(
    ("message", "want"),
    [
        (
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (150.00G) exceeds available HBM (95.74G).",
            (int(150 * GIB), int(95.74 * GIB)),
        ),
        (
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 17.50G of 15.75G hbm. Exceeded hbm capacity by 1.75G.",
            (int(17.5 * GIB), int(15.75 * GIB)),
        ),
        ("INTERNAL: something else (1.00G) exceeds available HBM (2.00G)", None),
        ("RESOURCE_EXHAUSTED: no numbers here", None),
    ],
)
def test_out_of_memory_messages(message, want) -> None:
    assert topology.parse_out_of_memory(message) == want


def test_chip_figures_and_overrides() -> None:
    class Dev:
        device_kind = "TPU v6 lite"

    assert topology.chip_of([Dev()]).hbm_gib == 32
    assert topology.chip_of([Dev()], hbm_gib=1.5).hbm_bytes == int(1.5 * GIB)
    Dev.device_kind = "TPU v99"
    with pytest.raises(ValueError, match="--hbm-gib"):
        topology.chip_of([Dev()])
    assert topology.chip_of([Dev()], hbm_gib=8).hbm_gib == 8
