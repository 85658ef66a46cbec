"""`server.mesh`: the engine on 8 simulated devices (expert=4, tensor=2) gives the same tokens,
behavior log-probs (1e-5) and routing ids as on one device, with params and KV cache sharded, and
swapped-in weights land on the same shardings (tests/conftest.py gives 8 CPU devices); a
bfloat16 server keeps its KV cache in bfloat16."""

from __future__ import annotations

import pathlib

import jax
import numpy as np

from rollout_server.engine import MoEEngine, unpack_step
from rollout_server.process import initial_model, serving_mesh
from sat_jax.decoding import SamplingConfig
from sat_jax.experiment import load_config, make_tokenizer

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "arith_tiny.yaml")
PROMPTS = ["12+7=", "3-45=", "9*9="]


def _engine(overrides: list[str]) -> MoEEngine:
    cfg = load_config(CONFIG, ["server.slots=4", *overrides])
    mesh = serving_mesh(cfg)
    return MoEEngine(
        initial_model(cfg, mesh),
        tokenizer=make_tokenizer(cfg),
        slots=4,
        max_prefill_length=16,
        max_decode_length=6,
        sampling=SamplingConfig(),
        mesh=mesh,
    )


def _run(engine: MoEEngine, steps: int = 6) -> list[dict]:
    state = engine.init_decode_state()
    for slot, text in enumerate(PROMPTS):
        ids = np.asarray(engine.tokenizer.encode_prompt(text), np.int32)
        prefix = engine.prefill(padded_tokens=np.pad(ids, (0, 16 - len(ids))), true_length=len(ids))
        state = engine.insert(prefix, state, slot)
    rows = []
    for _ in range(steps):
        state, result = engine.generate(None, state)
        c = engine.config
        rows.append(unpack_step(result.data, c.num_moe_layers, c.num_experts_per_tok))
    return rows


def test_sharded_engine_equals_one_device_and_swaps_onto_its_shardings() -> None:
    one = _engine([])
    sharded = _engine(["server.mesh.tensor=2", "server.mesh.expert=4"])
    assert len(one.mesh.devices.flat) == 1 and sharded.mesh.devices.size == 8
    params = sharded.current_params()[1]
    expert = params["layers"][1]["mlp"]["w_up_edf"]
    assert len(expert.sharding.device_set) == 8
    assert expert.addressable_shards[0].data.shape[0] == expert.shape[0] // 4
    for w, g in zip(_run(one), _run(sharded), strict=True):
        for key in ("token", "valid", "length", "version", "routing"):
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)
        np.testing.assert_allclose(g["logp"], w["logp"], atol=1e-5)

    host = jax.tree.map(lambda x: np.asarray(x) * 1.5, one.current_params()[1])
    sharded.swap_params(3, host)
    swapped = sharded.current_params()[1]
    same = jax.tree.map(lambda a, b: a.sharding == b.sharding, swapped, params)
    assert all(jax.tree.leaves(same))
    assert sharded.version == 3
    np.testing.assert_array_equal(
        np.asarray(swapped["embedding_vd"]), host["embedding_vd"].astype(np.float32)
    )


def test_bfloat16_serving_keeps_its_kv_cache_in_bfloat16() -> None:
    engine = _engine(["server.dtype=bfloat16", "server.mesh.tensor=2"])
    state = engine.init_decode_state()
    assert state.cache.k_lbsgh.dtype == state.cache.v_lbsgh.dtype == np.dtype("bfloat16")
    rows = _run(engine, steps=3)
    assert all(r["valid"][:3].all() and np.isfinite(r["logp"][:3]).all() for r in rows)
    assert all((r["logp"][:3] <= 0).all() for r in rows)
