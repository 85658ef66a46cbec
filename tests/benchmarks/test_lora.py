"""The LoRA benchmark (benchmarks/lora.py): a ``--quick`` run (the tiny preset) reports every
variant, with push bytes equal to a count of the pushed arrays and LoRA training fewer params."""

import json
import pathlib
import sys

import jax
import numpy as np
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import lora as bench  # noqa: E402

from sat_jax.model import ModelConfig, placement  # noqa: E402
from sat_jax.model.config import LoRAConfig  # noqa: E402
from sat_jax.model.lora import split_lora  # noqa: E402


def _count(cfg: ModelConfig) -> tuple[int, int]:
    """(base params, adapter params) of ``cfg``."""
    base, adapters = split_lora(nnx.to_pure_dict(placement.abstract_model(cfg)[1]))
    size = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))
    return size(base), size(adapters)


def test_quick_run_reports_push_bytes_and_step_memory(tmp_path):
    out = tmp_path / "lora.json"
    push, step = bench.main(["--quick", "--ranks", "8", "--json", str(out)])
    assert json.loads(out.read_text()) == {"push": push, "step": step}
    assert [r["variant"] for r in push] == [r["variant"] for r in step] == ["full", "lora r8"]
    tiny = ModelConfig.preset("tiny")
    n_base, _ = _count(tiny)
    lora = LoRAConfig(rank=8, alpha=16.0, targets=("attention", "experts"))
    _, n_adapters = _count(tiny.replace(lora=lora))
    # bfloat16 pushes: 2 bytes a parameter, the whole model or the adapters alone.
    assert [r["push_bytes"] for r in push] == [2 * n_base, 2 * n_adapters]
    assert push[1]["fraction_of_full"] == n_adapters / n_base
    assert [r["trained_params"] for r in step] == [n_base, n_adapters]
    for r in push + step:
        assert all(v > 0 for k, v in r.items() if k != "variant"), r
    table = bench.format_tables(bench.parse_args(["--quick", "--ranks", "8"]), push, step)
    assert "| lora r8 |" in table and "compiled temp" in table
