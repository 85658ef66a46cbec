"""The stability frontier (benchmarks/frontier.py, frontier_methods.py, frontier_report.py,
frontier_mechanism.py): its summary rules on synthetic runs, its method table, and the ``--smoke``
run."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import frontier  # noqa: E402
import frontier_mechanism  # noqa: E402
import frontier_methods  # noqa: E402
import frontier_report  # noqa: E402


def run(accuracy: dict[int, float], steps: int, *, skipped=(), q99=0.1) -> list[dict]:
    """Synthetic records: ``accuracy`` at its steps, ``skipped`` steps with a NaN loss."""
    records = [{"step": 0, "accuracy": accuracy[0]}]
    for s in range(1, steps + 1):
        r = {"step": s, "mismatch_abs_mean": 0.05, "loss": 0.1, "step_skipped": 0.0}
        r["d_abs_q99"] = q99(s) if callable(q99) else q99
        r["sat_q"] = 0.1 if s % 2 else 0.3
        if s in skipped:
            r.update(loss=math.nan, step_skipped=1.0)
        if s in accuracy:
            r["accuracy"] = accuracy[s]
        records.append(r)
    return records


def test_a_run_that_keeps_its_accuracy_is_stable():
    got = frontier_report.summarize_run(run({0: 0.2, 20: 0.3, 40: 0.28}, 40), reach=0.2)
    assert got["stable"] and not got["collapsed"] and got["collapse_step"] is None
    assert (got["best"], got["final"], got["base"]) == (0.3, 0.28, 0.2)
    assert got["sat_live"] == 0.5  # q = 0.1 < 0.2 on odd steps only


def test_a_drift_below_the_stable_line_is_unstable_but_not_collapsed():
    got = frontier_report.summarize_run(run({0: 0.2, 20: 0.3, 40: 0.2}, 40), reach=0.2)
    assert not got["stable"] and not got["collapsed"]  # 0.2 < 0.8·0.3, but > 0.5·0.3


def test_steps_to_collapse_is_the_first_evaluation_after_the_best_below_half():
    acc = {0: 0.2, 20: 0.14, 40: 0.3, 60: 0.2, 80: 0.1, 100: 0.05}  # 0.14 < 0.15 is before best
    q99 = lambda s: 1.0 if s > 60 else 0.5
    got = frontier_report.summarize_run(run(acc, 100, q99=q99), reach=0.2)
    assert got["collapsed"] and not got["stable"]
    assert got["collapse_step"] == 80
    # The tail is averaged over the TAIL_WINDOW steps ending at the collapse: 61..80 are 1.0.
    assert frontier_report.TAIL_WINDOW == 20 and got["tail_q99"] == pytest.approx(1.0)


def test_a_recovered_dip_is_not_a_collapse():
    got = frontier_report.summarize_run(run({0: 0.2, 20: 0.3, 40: 0.1, 60: 0.29}, 60), reach=0.2)
    assert not got["collapsed"] and got["stable"] and got["collapse_step"] is None


def test_a_skipped_step_storm_is_a_collapse_even_with_good_accuracy():
    storm = frontier_report.summarize_run(
        run({0: 0.2, 100: 0.3}, 100, skipped=range(30, 36)), reach=0.2
    )
    assert storm["collapsed"] and not storm["stable"] and storm["skipped"] == 6
    assert storm["collapse_step"] == 34  # the 5th bad step reaches 5% of 100
    one = frontier_report.summarize_run(run({0: 0.2, 100: 0.3}, 100, skipped=[50]), reach=0.2)
    assert one["stable"] and one["skipped"] == 1  # one skipped step is no storm


def test_a_cell_needs_two_of_three_stable_seeds():
    ok = frontier_report.summarize_run(run({0: 0.2, 20: 0.3}, 20), reach=0.2)
    bad = frontier_report.summarize_run(run({0: 0.2, 20: 0.3, 40: 0.05}, 40), reach=0.2)
    assert frontier_report.summarize_cell([ok, ok, bad])["stable"]
    cell = frontier_report.summarize_cell([ok, bad, bad])
    assert not cell["stable"] and cell["stable_seeds"] == 1 and cell["collapsed_seeds"] == 2
    assert cell["collapse_steps"] == [40, 40]
    assert cell["final_mean"] == pytest.approx((0.3 + 0.05 + 0.05) / 3)


@pytest.mark.parametrize(
    "stable, expected",
    [
        ({1e-3: True, 2e-3: True, 3e-3: False}, 2e-3),
        ({1e-3: True, 2e-3: False, 3e-3: True}, 1e-3),  # a lucky larger rate does not count
        ({1e-3: False, 2e-3: True}, None),
        ({3e-3: True, 1e-3: True}, 3e-3),  # order of the sweep does not matter
    ],
)
def test_largest_stable_lr(stable, expected):
    assert frontier_report.largest_stable_lr(stable) == expected


def test_the_edge_text_says_which_side_the_sweep_leaves_open():
    assert frontier_report.edge_text({1e-3: True}) == "≥ 0.001"  # nothing above ran
    assert frontier_report.edge_text({1e-3: True, 2e-3: False}) == "0.001"
    assert frontier_report.edge_text({2e-3: False}) == "< 0.002"  # nothing below ran
    assert frontier_report.edge_text({5e-4: False, 1e-3: True}) == "< 0.0005"


def test_large_lag_methods_map_to_their_options():
    want = {
        "GRPO+TIS": ("tis_cap", frontier.grid.TIS_CAP),
        "GRPO+IcePop": ("icepop_range", frontier_methods.ICEPOP_RANGE),
        "GRPO+SeqMask": ("seq_mask_range", frontier_methods.SEQ_MASK_RANGE),
        "GRPO+DPPO-TV": ("dppo_tv_delta", frontier.grid.DPPO_TV_DELTA),
        "GRPO+M2PO": ("m2_threshold", 0.04),
        "GRPO+VCPO": ("ess_scaling", True),
    }
    for method, (field, value) in want.items():
        cfg, replay = frontier_methods.loss_config(method)
        assert getattr(cfg, field) == value and not replay and not cfg.sat.enabled, method
        assert (cfg.ratio_level, cfg.clip_low, cfg.clip_high) == ("token", 0.2, 0.2)
        assert frontier_methods.microbatches(method) == 1
        needs = field in ("tis_cap", "icepop_range", "seq_mask_range")
        assert frontier_methods.needs_proximal(cfg) == needs, method
    assert frontier_methods.loss_config("GRPO+VCPO")[0].opob_baseline  # VCPO's both parts
    cfg, _ = frontier_methods.loss_config("GRPO+SAT-mbq", quantile=0.8)
    assert cfg.sat.enabled and cfg.sat.threshold_scope == "microbatch" and cfg.sat.quantile == 0.8
    assert frontier_methods.microbatches("GRPO+SAT-mbq") == frontier_methods.MICROBATCH_Q_K > 1
    assert frontier_methods.loss_config("GRPO+SAT")[0].sat.threshold_scope == "batch"
    args = frontier.parse_args(["--out", "x"])
    assert args.lags == [8, 32, 128, 64, 1]
    assert set(args.methods) == set(frontier_methods.GRPO_FAMILY) | set(frontier_methods.LARGE_LAG)


def test_the_sources_rows_and_the_controls_map_to_their_options():
    """Issue 44: M2PO's two token sets, VCPO's two ESS levels and its authors' recipe, VCPO's
    parts alone, the sources' bands with ours as variants, and the unclipped positive control."""
    get = lambda m: frontier_methods.loss_config(m)[0]
    assert get("GRPO+M2PO").m2_token_set == "trust_region"
    assert get("GRPO+M2PO-all").m2_token_set == "all"
    m2po = get("M2PO")  # the paper's objective: no ε-clip, the trust-region mask
    assert m2po.m2_token_set == "trust_region" and m2po.m2po and m2po.clip_high >= 1e9
    assert get("GRPO+VCPO").ess_level == "sequence" and get("GRPO+VCPO-tok").ess_level == "token"
    ess, opob = get("GRPO+ESS"), get("GRPO+OPOB")
    assert ess.ess_scaling and not ess.opob_baseline and opob.opob_baseline and not opob.ess_scaling
    vcpo = get("VCPO")
    assert vcpo.ess_scaling and vcpo.opob_baseline and vcpo.ess_level == "sequence"
    assert vcpo.seq_tis_cap == 8.0 and frontier_methods.needs_proximal(vcpo)
    for cfg in (vcpo, get("ISPG")):  # no PPO clip at any ratio a run sees
        assert 1.0 - cfg.clip_low < 2e-6 and cfg.clip_high >= 1e9
    ispg = get("ISPG")
    assert not ispg.rollout_corrections and not ispg.m2po and not ispg.sat.enabled
    assert get("GRPO+IcePop").icepop_range == (0.5, 5.0)
    assert get("GRPO+IcePop-ours").icepop_range == (0.5, 2.0)
    assert get("GRPO+SeqMask").seq_mask_range == (1 / 1.001, 1.001)
    assert get("GRPO+SeqMask-ours").seq_mask_range == (0.95, 1.05)


def test_constant_lag_mode_holds_the_lag_and_keys_differ_across_lags():
    bv = frontier_methods.behavior_version
    assert [bv(u, 4, "constant") for u in range(8)] == [0, 0, 0, 0, 0, 1, 2, 3]
    assert [bv(u, 4, "sync") for u in range(10)] == [
        frontier.grid.behavior_version(u, 4) for u in range(10)
    ]
    with pytest.raises(ValueError, match="lag mode"):
        bv(3, 2, "cyclic")
    Cell = frontier_methods.Cell
    keys = {
        (lag, mode): jax.random.key_data(
            frontier_methods.sample_key(Cell("GRPO", lag, 1e-3, 0, lag_mode=mode))
        ).tobytes()
        for lag in (1, 8, 32)
        for mode in frontier_methods.LAG_MODES
    }
    assert len(set(keys.values())) == len(keys)
    assert Cell("GRPO", 8, 1e-3, 0, lag_mode="constant").name == "GRPO_lag8_constant_lr0.001_seed0"
    assert Cell("GRPO", 8, 1e-3, 0).name == "GRPO_lag8_lr0.001_seed0"


def test_methods_and_knobs_map_to_the_loss_configs():
    cfg, replay = frontier_methods.loss_config("GRPO+SAT+R3", quantile=0.8, exponent=4.0)
    assert (cfg.ratio_level, cfg.sat.quantile, cfg.sat.exponent) == ("token", 0.8, 4.0) and replay
    cfg, replay = frontier_methods.loss_config("GSPOwide+SAT")
    assert cfg.ratio_level == "sequence" and cfg.sat.enabled and not replay
    assert cfg.clip_low == cfg.clip_high == frontier_methods.GSPO_WIDE_CLIP
    assert frontier_methods.sat_reach(cfg) == pytest.approx(
        -math.log1p(-frontier_methods.GSPO_WIDE_CLIP)
    )
    cfg, _ = frontier_methods.loss_config("GRPO", quantile=0.5)
    assert not cfg.sat.enabled  # knobs only reach SAT methods
    with pytest.raises(ValueError, match="unknown frontier method"):
        frontier_methods.loss_config("GSPO")
    assert frontier_methods.Cell("GRPO+SAT", 8, 2e-3, 1).name == "GRPO+SAT_lag8_lr0.002_seed1"
    assert frontier_methods.Cell("GRPO+SAT", 8, 2e-3, 1, 0.8, 4.0).name.endswith("_q0.8_p4_seed1")


def test_the_sampler_row_set_is_its_own_cell_and_report_row():
    cell = frontier_methods.Cell("GRPO+SAT", 8, 1e-3, 2, sampler_dtype="bfloat16", top_p=0.9)
    assert cell.name == "GRPO+SAT_lag8_lr0.001_bfloat16_top_p0.9_seed2"
    assert cell.row == "GRPO+SAT [bfloat16, top-p 0.9]"
    assert frontier_methods.row_method(cell.row) == "GRPO+SAT"
    plain = frontier_methods.Cell("GRPO+SAT", 8, 1e-3, 2)
    assert plain.row == "GRPO+SAT" and plain.sampler == frontier_methods.DEFAULT_SAMPLER
    rows = ["GRPO+TIS", cell.row, "GRPO+SAT", "GRPO"]
    assert sorted(rows, key=frontier_methods.row_order) == [
        "GRPO",
        "GRPO+SAT",
        cell.row,
        "GRPO+TIS",
    ]
    # A row set's seeds and the default sampler's are separate cells of the report.
    recs = run({0: 0.2, 20: 0.3}, 20)
    runs = {c: frontier_report.summarize_run(recs, 0.2) for c in (cell, plain)}
    table = frontier_report.cell_table(runs)
    assert set(table) == {
        (r, 8, 1e-3, frontier_methods.DEFAULT_SAT) for r in (cell.row, "GRPO+SAT")
    }
    args = frontier.parse_args(
        ["--out", "x", "--lags", "8", "--lrs", "1e-3", "--methods", "--sampler-methods", "GRPO"]
    )
    assert args.methods == [] and (args.sampler_dtype, args.top_p) == ("bfloat16", 0.9)
    got = frontier.phase_cells(args, "sampler", None)
    assert [c.name for c in got] == [
        f"GRPO_lag8_lr0.001_bfloat16_top_p0.9_seed{s}" for s in range(3)
    ]


def test_first_seed_shifts_the_seeds_of_every_cell():
    args = frontier.parse_args(
        ["--out", "x", "--lags", "32", "--lrs", "1e-3", "--methods", "GRPO", "--seeds", "2",
         "--first-seed", "3", "--lag-mode", "constant"]
    )  # fmt: skip
    got = frontier.phase_cells(args, "main", None)
    assert [c.name for c in got] == [f"GRPO_lag32_constant_lr0.001_seed{s}" for s in (3, 4)]


def test_the_sampler_table_sets_the_row_set_beside_the_default_sampler():
    def runs_of(mismatch0: float, live: float, final: float) -> dict:
        recs = run({0: 0.2, 20: final}, 20, q99=0.5)
        recs[1].update(mismatch_abs_mean=mismatch0, d_abs_q99=0.04)
        return {"records": recs, "sat_live": live, "final": final}

    bf16 = {"sampler_dtype": "bfloat16", "top_p": 0.9}
    runs = {
        frontier_methods.Cell("GRPO+SAT", 8, 1e-3, 0): runs_of(0.0, 0.5, 0.25),
        frontier_methods.Cell("GRPO+SAT", 8, 1e-3, 0, **bf16): runs_of(0.01, 0.2, 0.23),
        frontier_methods.Cell("GRPO+SAT", 8, 1e-3, 1, **bf16): runs_of(0.03, 0.4, 0.21),
        frontier_methods.Cell("GRPO", 32, 1e-3, 0): runs_of(0.0, 0.0, 0.2),  # no row set here
    }
    lines = frontier_mechanism.sampler_table(runs)
    assert (
        lines[-2] == "| GRPO+SAT | 8 | 0.001 | 1 | 0.0000 | 0.040 | 0.0475 | 0.48 | 50% | 0.250 |"
    )
    assert lines[-1] == (
        "| GRPO+SAT [bfloat16, top-p 0.9] | 8 | 0.001 | 2 | 0.0200 | 0.040 | 0.0485 | 0.48 | "
        "30% | 0.220 |"
    )
    assert frontier_mechanism.sampler_table({k: runs[k] for k in list(runs)[:1]}) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--sampler-dtype", "int8"], "--sampler-dtype must be a floating dtype, got 'int8'"),
        (["--sampler-dtype", "bf17"], "--sampler-dtype must be a floating dtype, got 'bf17'"),
        (["--sampler-methods", "PPO"], "unknown frontier method 'PPO'"),
        (["--first-seed", "-1"], "--first-seed must be >= 0, got -1"),
    ],
)
def test_bad_sampler_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        frontier.parse_args(["--out", "x", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.slow  # a subprocess that trains eighteen tiny runs
def test_smoke_run_writes_tables_pictures_and_per_step_fields(tmp_path):
    out = tmp_path / "frontier"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as users run it
    cmd = [sys.executable, str(REPO / "benchmarks" / "frontier.py"), "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    check_smoke_output(out)


def check_smoke_output(out: pathlib.Path) -> None:
    """What ``--smoke`` must leave in ``out`` (also usable on a smoke run made by hand)."""
    names = sorted(p.name for p in (out / "cells").iterdir())
    main = [
        f"{m}_lag{lag}_lr0.001_seed0.jsonl"
        for m in ("GRPO+SAT", *frontier_methods.LARGE_LAG)
        for lag in (2, 128)
    ]
    knobs_and_gspo = [
        "GRPO+SAT_lag2_lr0.001_q0.8_p1_seed0.jsonl",
        "GSPOwide+SAT_lag2_lr0.001_seed0.jsonl",
    ]
    row_set = [f"{m}_lag2_lr0.001_bfloat16_top_p0.9_seed0.jsonl" for m in ("GRPO+SAT", "GRPO+TIS")]
    assert names == sorted(main + knobs_and_gspo + row_set)

    def records(name):
        lines = (out / "cells" / name).read_text().splitlines()
        head, recs = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
        return head, [r for r in recs if "lag" in r], recs

    head, steps, recs = records("GRPO+SAT_lag2_lr0.001_seed0.jsonl")
    assert head["cell"]["lr"] == 1e-3 and head["reach"] == pytest.approx(-math.log(0.8))
    assert [r["lag"] for r in steps] == [0, 1, 2, 1]
    assert all(r["d_abs_q99"] >= 0 and "sat_q" in r and "step_skipped" in r for r in steps)
    assert steps[0]["d_abs_q99"] < 1e-4  # lag 0: behavior = current weights
    assert [r["step"] for r in recs if "accuracy" in r] == [0, 2, 4]
    # Lag 128 in 4 steps: the first weights generate every batch.
    assert [r["lag"] for r in records("GRPO+M2PO_lag128_lr0.001_seed0.jsonl")[1]] == [0, 1, 2, 3]
    # Every method logs the ESS; each new option its own metrics.
    expected = {
        "GRPO+M2PO": "m2po_masked_frac",
        "GRPO+VCPO": "ess_step_scale",
        "GRPO+TIS": "tis_weight_mean",
        "GRPO+IcePop": "icepop_kept_frac",
        "GRPO+SeqMask": "seq_masked_frac",
        "GRPO+DPPO-TV": "dppo_tv_masked_frac",
        "GRPO+SAT-mbq": "sat_q",
    }
    for method, metric in expected.items():
        for lag in (2, 128):
            _, steps, _ = records(f"{method}_lag{lag}_lr0.001_seed0.jsonl")
            assert all(0.0 < r["ess"] <= 1.0 + 1e-6 and metric in r for r in steps), method
    # The sampler row set: bfloat16, top-p 0.9, its truncation replayed by the step and by the
    # proximal forward, so at lag 0 the log-probs differ by bfloat16 rounding alone.
    for method in ("GRPO+SAT", "GRPO+TIS"):
        head, steps, _ = records(f"{method}_lag2_lr0.001_bfloat16_top_p0.9_seed0.jsonl")
        assert (head["cell"]["sampler_dtype"], head["cell"]["top_p"]) == ("bfloat16", 0.9)
        assert [r["lag"] for r in steps] == [0, 1, 2, 1]
        assert 0 < steps[0]["d_abs_q99"] < 0.5 and math.isfinite(steps[0]["mismatch_abs_mean"])
    vcpo = records("GRPO+VCPO_lag128_lr0.001_seed0.jsonl")[1]
    assert all(r["ess_step_scale"] == pytest.approx(math.sqrt(r["ess"]), rel=1e-5) for r in vcpo)
    assert all(r["opob_shift"] >= 0.0 for r in vcpo)  # VCPO's baseline is on
    table = (out / "frontier.md").read_text()
    cost = json.loads((out / "cost.json").read_text())  # --smoke times one step per method
    assert set(cost) == {"GRPO+SAT", *frontier_methods.LARGE_LAG} and all(
        t > 0 for t in cost.values()
    )
    assert "**Cost**" in table and "| GRPO+VCPO |" in table
    assert "**Mechanism**" in table and "| GRPO+IcePop | 128 | 0.001 |" in table
    assert "| GRPO+SAT | 2 |" in table and "SAT's knobs" in table and "| q = 0.8 |" in table
    assert "| GRPO+M2PO | 128 |" in table and "| GRPO+VCPO | 128 |" in table
    assert "| GRPO+TIS [bfloat16, top-p 0.9] | 2 |" in table
    assert "**The sampler row set**" in table
    assert "| GRPO+TIS [bfloat16, top-p 0.9] | 2 | 0.001 | 1 |" in table
    summary = json.loads((out / "frontier_summary.json").read_text())
    assert {(r["row"], r["lag"], r["quantile"], r["exponent"]) for r in summary} == {
        *(
            (m, lag, 0.9, 2.0)
            for m in ("GRPO+SAT", *frontier_methods.LARGE_LAG)
            for lag in (2, 128)
        ),
        ("GRPO+SAT", 2, 0.8, 1.0),
        ("GSPOwide+SAT", 2, 0.9, 2.0),
        ("GRPO+SAT [bfloat16, top-p 0.9]", 2, 0.9, 2.0),
        ("GRPO+TIS [bfloat16, top-p 0.9]", 2, 0.9, 2.0),
    }
    assert all(r["seeds"] == 1 and "final_mean" in r and "stable" in r for r in summary)
    assert (out / "frontier_heatmap.png").stat().st_size > 0
    assert (out / "frontier_q_reach.png").stat().st_size > 0


def test_knob_rate_auto_is_plain_grpos_frontier_at_the_knob_lag(tmp_path):
    (tmp_path / "cells").mkdir()
    ok = run({0: 0.2, 20: 0.3}, 20)
    bad = run({0: 0.2, 20: 0.3, 40: 0.05}, 40)
    for lr, recs in ((1e-3, ok), (1.5e-3, bad), (2e-3, bad)):
        for seed in range(3):
            cell = frontier_methods.Cell("GRPO", 8, lr, seed)
            head = {"cell": frontier.dataclasses.asdict(cell), "seconds": 1.0, "reach": 0.2}
            text = "\n".join(json.dumps(x) for x in [head, *recs])
            frontier.cell_path(tmp_path, cell).write_text(text + "\n")
    args = frontier.parse_args(["--out", str(tmp_path), "--lrs", "1e-3", "1.5e-3", "2e-3"])
    assert frontier.pick_knob_lr(args) == 1.5e-3
    args.knob_lag = 16  # nothing ran there: the largest rate
    assert frontier.pick_knob_lr(args) == 2e-3
    args.knob_lr = "1e-3"
    assert frontier.pick_knob_lr(args) == 1e-3


def test_mechanism_is_the_window_before_collapse_and_the_methods_own_mask():
    recs = run({0: 0.2, 20: 0.3, 40: 0.05}, 40, q99=lambda s: float(s))
    for r in recs[1:]:
        r["lag"] = r["step"] % 4
        r.update(ess=0.5 if r["step"] <= 20 else 0.1, clip_frac_low=0.01, clip_frac_high=0.02)
        r.update(icepop_kept_frac=0.75, ess_step_scale=0.3)
    got = frontier_mechanism.run_mechanism("GRPO+IcePop", recs, end=20, window=10)
    assert (
        got["lag"] == pytest.approx(1.5)
        and got["q99"] == pytest.approx(15.5)
        and got["ess"] == pytest.approx(0.5)
    )
    assert got["clip"] == pytest.approx(0.03) and got["masked"] == pytest.approx(0.25)
    assert got["ess_scale"] == pytest.approx(0.3) and math.isnan(got["opob_shift"])
    assert math.isnan(frontier_mechanism.run_mechanism("GRPO", recs, 20, 10)["masked"])
    assert frontier_mechanism.masked_metric("GRPO+SAT+R3")[0] == "sat_gate_rate"
    cell = frontier_mechanism.cell_mechanism(
        [("GRPO", recs, 40, True), ("GRPO", recs, 20, False), ("GRPO", recs, 20, False)], 10
    )
    assert (cell["collapsed"]["seeds"], cell["stable"]["seeds"]) == (1, 2)
    assert cell["collapsed"]["ess"] == pytest.approx(0.1) and cell["stable"]["ess"] == 0.5


def test_time_steps_interleaves_and_takes_the_median():
    calls = []
    got = frontier_mechanism.time_steps(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1
    )
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"] and set(got) == {"a", "b"}
    assert all(t >= 0.0 for t in got.values())


def test_within_noise_is_two_standard_errors_of_the_difference_from_the_best():
    cell = lambda mean, std: {"final_mean": mean, "final_std": std, "seeds": 3}
    knobs = frontier_methods.DEFAULT_SAT
    table = {
        ("GRPO", 128, 1e-3, knobs): cell(0.20, 0.03),
        ("GRPO+VCPO", 128, 1e-3, knobs): cell(0.26, 0.0),
        ("GRPO+TIS", 128, 1e-3, knobs): cell(0.10, 0.0),
        ("GRPO", 1, 1e-3, knobs): cell(0.3, 0.0),
    }
    got = frontier_report.within_noise(table)
    # 0.26 − 0.20 = 0.06 > 2·sqrt(0.03²/3) ≈ 0.035: GRPO is outside, TIS far outside.
    assert got[(128, 1e-3)] == ("GRPO+VCPO", ["GRPO+VCPO"])
    table[("GRPO", 128, 1e-3, knobs)] = cell(0.23, 0.03)  # 0.03 ≤ 0.035: within
    assert frontier_report.within_noise(table)[(128, 1e-3)] == ("GRPO+VCPO", ["GRPO", "GRPO+VCPO"])
    assert got[(1, 1e-3)] == ("GRPO", ["GRPO"])


def test_8bit_rollouts_are_their_own_cells_paired_with_bfloat16_rollouts():
    args = frontier.parse_args(
        ["--out", "x", "--lrs", "1e-3", "--methods", "--seeds", "2", "--lag-mode", "constant",
         "--quant-methods", "GRPO+TIS", "--quant-lags", "1", "--quant-weights", "int8"]
    )  # fmt: skip
    got = [c.name for c in frontier.phase_cells(args, "quant", None)]
    assert got == [
        "GRPO+TIS_lag1_constant_lr0.001_bfloat16_wint8_kvfp8_seed0",
        "GRPO+TIS_lag1_constant_lr0.001_bfloat16_seed0",
        "GRPO+TIS_lag1_constant_lr0.001_bfloat16_wint8_kvfp8_seed1",
        "GRPO+TIS_lag1_constant_lr0.001_bfloat16_seed1",
    ]
    cells = frontier.phase_cells(args, "quant", None)
    assert cells[0].row == "GRPO+TIS [bfloat16, top-p 1, int8 weights, fp8 cache]"
    assert cells[1].row == "GRPO+TIS [bfloat16, top-p 1]"
    assert frontier_methods.row_method(cells[0].row) == "GRPO+TIS"
    # An unquantized cell keeps its name (cells of earlier studies are found again).
    assert frontier_methods.Cell("GRPO", 8, 1e-3, 0).name == "GRPO_lag8_lr0.001_seed0"

    def runs_of(final: float, kl0: float, d0: float) -> dict:
        recs = run({0: 0.2, 20: final}, 20)
        recs[1].update(mismatch_abs_mean=d0, sampler_kl=kl0)
        return {**frontier_report.summarize_run(recs, 0.2), "records": recs}

    runs = {
        cells[0]: runs_of(0.24, 1e-3, 0.03),
        cells[1]: runs_of(0.20, 1e-5, 0.004),
        cells[2]: runs_of(0.20, 3e-3, 0.05),
        cells[3]: runs_of(0.22, 3e-5, 0.006),
    }
    lines = frontier_mechanism.quant_table(runs)
    assert lines[-2] == (
        "| GRPO+TIS | 1 | 0.001 | int8 weights, fp8 cache | 2 | 2/2 | 0/2 | 0.220 ± 0.028 | "
        "0.240 0.200 | +0.010 ± 0.030 (n = 2) | 1-0-1 | 2.00e-03 | 0.0400 | 2.00e-03 | 0.0495 |"
    )
    assert lines[-1].startswith("| GRPO+TIS | 1 | 0.001 | bfloat16 | 2 | 2/2 | 0/2 | 0.210 ± ")
    assert frontier_mechanism.quant_table({cells[1]: runs[cells[1]]}) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--quant-methods", "GRPO", "--quant-weights", "int4"], "--quant-weights must be int8"),
        (["--quant-methods", "GRPO", "--quant-cache", "bfloat16"], "--quant-cache must be int8"),
        (["--quant-methods", "PPO"], "unknown frontier method 'PPO'"),
    ],
)
def test_bad_8bit_rollout_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        frontier.parse_args(["--out", "x", *flags])
    assert message in capsys.readouterr().err
