"""The LoRA mode of the 8-bit serving benchmark (benchmarks/quant.py ``--lora``): its adapters
are the size asked for, its "merged" weights are what an 8-bit engine serves after a LoRA push,
its "adapters" weights are dequantize(quantize(W)) + scale · A B, and a tiny run reports every
row."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import quant as bench  # noqa: E402

from rollout_server.engine import MoEEngine  # noqa: E402
from rollout_server.weights import WeightsLoader  # noqa: E402
from sat_jax import params_io, quant, sharding  # noqa: E402
from sat_jax.decoding import SamplingConfig  # noqa: E402
from sat_jax.model.config import LoRAConfig  # noqa: E402
from sat_jax.model.layers import LORA_A, LORA_B  # noqa: E402
from sat_jax.model.lora import abstract_adapters, init_lora  # noqa: E402
from sat_jax.tasks import CharTokenizer  # noqa: E402

LORA = LoRAConfig(rank=4, alpha=bench.LORA_ALPHA, targets=bench.LORA_TARGETS)
BF16 = jnp.bfloat16


@pytest.fixture(scope="module")
def model():
    cfg, masters = bench.tiny_model()
    masters = jax.tree.map(lambda x: x.astype(jnp.float32), masters)
    return cfg, masters, bench.lora_adapters(cfg, masters, LORA, 0.03)


def _targets(adapters):
    flat = traverse_util.flatten_dict(adapters)
    return [(*p[:-1], p[-1][: -len(LORA_A)]) for p in flat if p[-1].endswith(LORA_A)]


def _pair(adapters, target):
    flat = traverse_util.flatten_dict(adapters)
    a = flat[(*target[:-1], target[-1] + LORA_A)]
    return np.asarray(a, np.float64), np.asarray(flat[(*target[:-1], target[-1] + LORA_B)])


def _delta(w_shape, a, b) -> np.ndarray:
    """scale · A B in float64 for add_lora's layouts (stacked experts: [E, in, r], [E, r, out])."""
    b = np.asarray(b, np.float64)
    if a.ndim + b.ndim - 2 > len(w_shape):
        d = np.einsum("eir,ero->eio", a, b.reshape(b.shape[0], b.shape[1], -1))
    else:
        d = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
    return LORA.scale * d.reshape(w_shape)


def test_adapters_are_the_model_s_a_and_a_b_of_the_asked_norm(model):
    cfg, masters, adapters = model
    fresh = traverse_util.flatten_dict(init_lora(cfg.replace(lora=LORA), rng=0))
    flat_w = traverse_util.flatten_dict(masters)
    targets = _targets(adapters)
    assert {t[-1] for t in targets} >= {"w_q_dnh", "w_o_nhd", "w_gate_edf", "w_down_efd"}
    for t in targets:
        a, b = _pair(adapters, t)
        np.testing.assert_array_equal(a, fresh[(*t[:-1], t[-1] + LORA_A)])
        w = np.asarray(flat_w[t], np.float64)
        ratio = np.linalg.norm(_delta(w.shape, a, b)) / np.linalg.norm(w)
        np.testing.assert_allclose(ratio, 0.03, rtol=1e-4, err_msg=str(t))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_merged_weights_are_what_an_8_bit_engine_serves_after_the_lora_push(model, tmp_path, fmt):
    cfg, masters, adapters = model
    served = bench.lora_served(cfg, masters, adapters, LORA, fmt, "merged", tmp_path / "bench")
    # The server's own path, separately: push files, loader, then the engine's install.
    bf16_cfg = cfg.replace(param_dtype=BF16)
    base = jax.tree.map(lambda x: x.astype(BF16), masters)
    engine = MoEEngine(
        nnx.merge(bench._graphdef(bf16_cfg), base),
        tokenizer=CharTokenizer("0123456789+-*=() "),
        slots=1,
        max_prefill_length=16,
        max_decode_length=4,
        sampling=SamplingConfig(),
        weight_dtype=fmt,
    )
    root = tmp_path / "root"
    params_io.save_params(root / "base-v1", base)
    params_io.save_params(root / "v1", jax.tree.map(lambda x: x.astype(BF16), adapters))
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    loader = WeightsLoader(str(root), LORA, abstract_adapters(bf16_cfg.replace(lora=LORA), mesh))
    loaded = loader.load(str(root / "v1"), str(root / "base-v1"), base)
    engine.swap_params(1, loaded.params)
    want = jax.tree.leaves(engine.served_params()[1])
    got = jax.tree.leaves(served)
    assert quant.tree_format(served) == fmt
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_unquantized_adapters_add_to_the_dequantized_8_bit_base(model, tmp_path, fmt):
    cfg, masters, adapters = model
    served = bench.lora_served(cfg, masters, adapters, LORA, fmt, "adapters", tmp_path)
    assert quant.tree_format(served) == "bfloat16"  # nothing left to quantize on install
    base = jax.tree.map(lambda x: x.astype(BF16), masters)
    deq = traverse_util.flatten_dict(quant.dequantize_params(quant.quantize_params(base, fmt)))
    flat = traverse_util.flatten_dict(served)
    targets = _targets(adapters)
    for path, x in flat.items():
        if path not in targets:  # quantized-dequantized, or (router, norms) the bfloat16 cast
            np.testing.assert_array_equal(np.asarray(x), np.asarray(deq[path]), str(path))
            continue
        a, b = _pair(jax.tree.map(lambda v: v.astype(BF16), adapters), path)
        w = np.asarray(deq[path], np.float64)
        want = w + _delta(w.shape, a, b)
        assert x.dtype == BF16
        # One bfloat16 rounding of the sum (8 mantissa bits: half an ulp is 2^-9 relative).
        np.testing.assert_allclose(np.asarray(x, np.float64), want, rtol=2**-8, atol=1e-6)
        assert not np.array_equal(np.asarray(x), np.asarray(deq[path]))
    # The two ways' adapted weights differ, by less than the 8-bit error of each.
    merged = bench.lora_served(cfg, masters, adapters, LORA, fmt, "merged", tmp_path / "m")
    e_merged = bench.adapted_error(merged, masters, adapters, LORA)
    e_adapters = bench.adapted_error(served, masters, adapters, LORA)
    bf16 = bench.lora_served(cfg, masters, adapters, LORA, "bfloat16", "merged", tmp_path / "b")
    e_bf16 = bench.adapted_error(bf16, masters, adapters, LORA)
    assert e_bf16 < e_merged and e_bf16 < e_adapters
    assert e_merged != e_adapters


def test_a_tiny_lora_run_reports_the_bfloat16_row_and_both_ways(capsys):
    args = ["--lora", "--models", "tiny", "--slots", "2", "--new-tokens", "3", "--prompt-len", "4"]
    assert bench.main([*args, "--configs", "int8:bfloat16"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[1:4] for c in cells] == [
        ["bfloat16", "bfloat16", "bfloat16 (W + BA)"],
        ["int8", "bfloat16", "merged"],
        ["int8", "bfloat16", "adapters"],
    ]
    assert cells[0][6] == cells[0][8] == cells[0][10] == "1.0x"
    for c in cells:
        figures = [float(c[i]) for i in (4, 5, 7, 9)]
        assert all(np.isfinite(v) and v > 0 for v in figures), c


def test_lora_mode_refuses_an_unquantized_weights_pair():
    with pytest.raises(SystemExit, match="name 8-bit weights"):
        bench.parse_args(["--lora", "--configs", "bfloat16:int8"])
