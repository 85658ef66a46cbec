"""sat-export and sat-eval on a run's checkpoint: the export loads back exactly and in
transformers (same logits, tokenizer), bad input is one line and exit 2, and sat-eval prints
avg@K / pass@K / greedy accuracy and writes its JSON (8 simulated devices, tests/conftest.py)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sat_jax import sharding
from sat_jax.experiment import load_config
from sat_jax.model import hf, make_tiny, placement
from sat_jax.step import create_train_state
from train import checkpointing, eval_checkpoint, export, setup

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _save_checkpoint(cfg, step: int, shift: float) -> dict:
    """A checkpoint of the config's model (from model.hf_path, else the base init), every
    parameter moved by ``shift`` (so "weights changed by training" is visible)."""
    mesh = sharding.make_mesh(cfg.train.mesh)
    if cfg.model.hf_path:
        _, params = hf.load_params(cfg.model.hf_path, cfg.model)
    else:
        _, params = placement.init_sharded(cfg.model, mesh, 0)
    params = jax.tree.map(lambda x: x + shift, params)
    optimizer = cfg.train.optimizer.make(cfg.train.steps)
    state = create_train_state(cfg.model, optimizer, mesh, params)
    progress = checkpointing.Progress(version=step, min_version=1, rng_key=(0, 0))
    with checkpointing.Checkpointer(setup.run_paths(cfg)[1], keep=3) as ckpt:
        ckpt.save(step, state, progress)
    return jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_run")
    make_tiny.make_tiny(root / "tiny")
    overrides = [f"model.hf_path={root / 'tiny'}", f"train.run_dir={root / 'run'}"]
    cfg = load_config(None, overrides)
    params = _save_checkpoint(cfg, 2, 0.01)
    return root, overrides, params


@pytest.mark.slow  # export, then the model in transformers (torch)
def test_export_round_trip_and_transformers(hf_run, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root, overrides, params = hf_run
    out = root / "export"
    export.cli([*overrides, "--out", str(out)])
    assert capsys.readouterr().out.strip() == f"exported checkpoint 2 to {out}"
    cfg = load_config(None, overrides)
    _, back = hf.load_params(out, cfg.model)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), back, params)
    assert all(jax.tree.leaves(same))
    _, base = hf.load_params(root / "tiny", cfg.model)
    assert not np.array_equal(np.asarray(base["embedding_vd"]), params["embedding_vd"])

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("Tom has 12 apples.")["input_ids"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits.numpy()
    model = nnx.merge(placement.abstract_model(cfg.model)[0], back)
    np.testing.assert_allclose(np.asarray(model(np.asarray([ids]))), want, atol=1e-4, rtol=1e-4)
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [tok.eos_token_id, tok.pad_token_id]  # <|im_end|>, <|endoftext|>


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step", "7"], "sat-export: --step: no checkpoint 7 in {ckpt} (have [2])"),
        (
            ["train.run_dir={root}/nowhere"],
            "sat-export: no checkpoint directory {root}/nowhere/checkpoints",
        ),
        (["--out", "{root}/tiny"], "sat-export: --out {root}/tiny exists and is not empty"),
    ],
)
def test_export_bad_input_is_one_line_and_exit_2(hf_run, capsys, args, message):
    root, overrides, _ = hf_run
    args = [a.format(root=root) for a in args]
    out = [] if "--out" in args else ["--out", str(root / "never")]
    with pytest.raises(SystemExit) as exit_info:
        export.cli([*overrides, *out, *args])
    assert exit_info.value.code == 2
    ckpt = root / "run" / "checkpoints"
    assert capsys.readouterr().err.strip().splitlines() == [message.format(root=root, ckpt=ckpt)]
    assert not (root / "never").exists()


def test_export_python_m_form(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "train.export", "--out", str(tmp_path / "x"), "model.bogus=1"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["sat-export: model.bogus: unknown key"]


@pytest.mark.slow  # evaluation end to end, twice, and an export
def test_eval_of_checkpoint_and_of_its_export_agree(tmp_path, capsys):
    overrides = [f"train.run_dir={tmp_path / 'run'}", "server.slots=4"]
    config = str(ROOT / "configs" / "arith_tiny.yaml")
    cfg = load_config(config, overrides)
    _save_checkpoint(cfg, 5, 0.0)
    eval_checkpoint.cli(["--config", config, *overrides, "--k", "3", "--problems", "5"])
    printed = capsys.readouterr().out
    assert "avg@3" in printed and "pass@3" in printed and "greedy" in printed
    doc = json.loads((tmp_path / "run" / "eval" / "step-5.json").read_text())
    assert doc["policy"] == "step-5" and doc["k"] == 3 and doc["problems"] == 5
    assert len(doc["rows"]) == 5 and all(len(r["rewards"]) == 3 for r in doc["rows"])
    assert doc["avg_at_k"] == pytest.approx(np.mean([r["rewards"] for r in doc["rows"]]))
    assert doc["pass_at_k"] == pytest.approx(np.mean([max(r["rewards"]) for r in doc["rows"]]))
    assert doc["pass_at_k"] >= doc["avg_at_k"]

    export.cli(["--config", config, *overrides, "--out", str(tmp_path / "hf")])
    capsys.readouterr()
    out = tmp_path / "hf.json"
    eval_checkpoint.cli(["--config", config, *overrides, "--hf", str(tmp_path / "hf"), "--k", "3",
                  "--problems", "5", "--out", str(out)])  # fmt: skip
    again = json.loads(out.read_text())
    assert again["policy"] == "hf"
    assert {k: v for k, v in again.items() if k != "policy"} == {
        k: v for k, v in doc.items() if k != "policy"
    }


def test_eval_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_checkpoint.cli([f"train.run_dir={tmp_path}", "--k", "2", "--problems", "3"])
    assert exit_info.value.code == 2
    want = f"sat-eval: no checkpoint directory {tmp_path}/checkpoints"
    assert capsys.readouterr().err.strip().splitlines() == [want]


# LoRA runs.
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[attention,experts,router]"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run's checkpoint (step 3) on make_tiny's checkpoint, every B non-zero; returns
    (root, overrides, the whole model's params on the host)."""
    root = tmp_path_factory.mktemp("lora_run")
    make_tiny.make_tiny(root / "tiny")
    overrides = [f"model.hf_path={root / 'tiny'}", f"train.run_dir={root / 'run'}", *LORA]
    cfg = load_config(None, overrides)
    mesh = sharding.make_mesh(cfg.train.mesh)
    _, params = setup.base_policy(cfg, mesh)
    keys = iter(jax.random.split(jax.random.key(4), 64))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            0.2 * jax.random.normal(next(keys), x.shape, x.dtype)
            if str(p[-1].key).endswith("_lora_b")
            else x
        ),
        params,
    )
    optimizer = cfg.train.optimizer.make(cfg.train.steps)
    state = create_train_state(cfg.model, optimizer, mesh, params)
    progress = checkpointing.Progress(version=3, min_version=1, rng_key=(0, 0))
    with checkpointing.Checkpointer(setup.run_paths(cfg)[1], keep=3) as ckpt:
        ckpt.save(3, state, progress)
    return root, overrides, jax.tree.map(np.asarray, jax.device_get(params))


def _lora_logits(cfg, params, ids) -> np.ndarray:
    model = nnx.merge(placement.abstract_model(cfg.model)[0], params)
    return np.asarray(model(np.asarray([ids])))


@pytest.mark.slow  # two exports, the base and the export in transformers, and peft (torch)
def test_lora_run_exports_merged_and_as_a_peft_adapter(lora_run, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root, overrides, params = lora_run
    cfg = load_config(None, overrides)
    ids = transformers.AutoTokenizer.from_pretrained(root / "tiny")("Tom has 12 apples.")
    ids = ids["input_ids"]
    want = _lora_logits(cfg, params, ids)
    logits = lambda m: m(torch.tensor([ids])).logits.detach().numpy()

    export.cli([*overrides, "--out", str(root / "merged")])
    assert capsys.readouterr().out.strip() == f"exported checkpoint 3 to {root / 'merged'}"
    original, merged = hf.read_checkpoint(root / "tiny"), hf.read_checkpoint(root / "merged")
    assert sorted(original) == sorted(merged)
    for name in original:  # the targets changed, every other tensor bit for bit the base's
        target = any(s in name for s in ("_proj.", "mlp.gate.weight", "mlp.experts."))
        assert np.array_equal(original[name], merged[name]) != target, name
    ref = transformers.AutoModelForCausalLM.from_pretrained(root / "merged").eval()
    np.testing.assert_allclose(logits(ref), want, atol=1e-4, rtol=1e-4)

    export.cli([*overrides, "--out", str(root / "adapter"), "--adapter"])
    assert capsys.readouterr().out.strip() == (
        f"exported adapter of checkpoint 3 to {root / 'adapter'}"
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "tiny").eval()
    assert np.abs(logits(base) - want).max() > 1e-2  # the adapters matter
    adapted = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    np.testing.assert_allclose(logits(adapted), want, atol=1e-4, rtol=1e-4)


def test_lora_eval_reads_base_plus_adapters_and_the_merged_export(lora_run, tmp_path):
    root, overrides, params = lora_run
    cfg = load_config(None, overrides)
    label, _, got = eval_checkpoint.policy_params(cfg, step=None, hf_dir=None)
    assert label == "step-3"
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), got, params)
    assert all(jax.tree.leaves(same))
    export.export_run(cfg, tmp_path / "merged")
    label, _, from_hf = eval_checkpoint.policy_params(
        cfg, step=None, hf_dir=str(tmp_path / "merged")
    )
    assert label == "hf"
    ids = list(range(3, 20))
    np.testing.assert_allclose(
        _lora_logits(cfg, from_hf, ids), _lora_logits(cfg, params, ids), atol=1e-5, rtol=1e-5
    )


def test_lora_export_and_eval_refuse_another_base(lora_run, tmp_path):
    root, overrides, _ = lora_run
    make_tiny.make_tiny(tmp_path / "other", seed=1)
    cfg = load_config(None, [*overrides, f"model.hf_path={tmp_path / 'other'}"])
    with pytest.raises(export.ExportError, match="checkpoint 3: the base model differs"):
        export.export_run(cfg, tmp_path / "out")
    with pytest.raises(
        eval_checkpoint.EvalInputError, match="checkpoint 3: the base model differs"
    ):
        eval_checkpoint.policy_params(cfg, step=None, hf_dir=None)
    assert not (tmp_path / "out").exists()
    full = load_config(None, [f"train.run_dir={root / 'run'}"])
    with pytest.raises(export.ExportError, match="--adapter needs a LoRA run"):
        export.export_run(full, tmp_path / "out", adapter=True)
