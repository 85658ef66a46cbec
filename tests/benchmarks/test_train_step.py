"""The train-step benchmark (benchmarks/train_step.py): its FLOP count, its argument checks and
its ``--quick`` run (the tiny preset, every configuration once compiled and timed)."""

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import train_step as bench  # noqa: E402

from sat_jax.model import ModelConfig  # noqa: E402


def test_step_flops_match_a_hand_count_of_the_tiny_preset():
    # tiny: D 64, V 64, 2 MoE layers of 4 q heads and 2 kv heads of 16, K = 2 experts of width 32.
    # Matmul parameters: the LM head 64·64, and per layer q,o 2·64·64 + k,v 2·64·32, router 64·8
    # and the active experts 2·3·64·32. Norm weights (384 in all) are within the 1% tolerance.
    matmul = 64 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 64 * 8 + 2 * 3 * 64 * 32)
    attention = 12 * 2 * 4 * 16 * 64
    got = bench.step_flops(ModelConfig.preset("tiny"), 4, 64)
    assert got == pytest.approx(4 * 64 * (6 * matmul + attention), rel=1e-2)


@pytest.mark.parametrize(
    "argv, message",
    [(["--batch", "6"], "multiple of 4"), (["--seq-lens", "512,x"], "comma-separated")],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_quick_run_reports_every_configuration(tmp_path):
    out = tmp_path / "rows.json"
    bench.main(["--quick", "--json", str(out)])
    rows = json.loads(out.read_text())
    configs = {(r["remat"], r["microbatches"]) for r in rows}
    assert configs == {("none", 1), ("none", 4), ("layer", 1), ("layer", 4)}
    for r in rows:
        assert r["seq_len"] == 64 and r["repeats"] == 2
        assert r["tokens_per_s"] == pytest.approx(4 * 64 / r["median_s"])
        assert 0 < r["mfu"] < 1 and r["peak_flops"] > 0
