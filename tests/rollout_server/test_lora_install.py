"""The server's LoRA install (`rollout_server.weights.WeightsLoader`): adapters over a kept base,
merged into the served weights; the base read only when a push names another one."""

from __future__ import annotations

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from rollout_api.proto import rollout_pb2
from rollout_server.weights import CheckpointPathError, WeightsLoader
from sat_jax import params_io, sharding
from sat_jax.experiment import load_config
from sat_jax.model import ModelConfig, Transformer, placement
from sat_jax.model.config import LoRAConfig
from sat_jax.model.lora import abstract_adapters, init_lora, join_lora
from tests.rollout_server.conftest import CONFIG, SHAPES, stats

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("attention", "experts", "router"))


def _configs(dtype=jnp.float32) -> tuple[ModelConfig, ModelConfig]:
    """(the served model: no adapters; the trainer's: with them), both in `dtype`."""
    base = ModelConfig.preset("tiny").replace(param_dtype=dtype, dtype=jnp.float32)
    return base, base.replace(lora=LORA)


def _adapters(cfg: ModelConfig, seed: int) -> dict:
    """Adapters with non-zero B, so the merge matters."""
    fresh = init_lora(cfg, rng=seed)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.05, x.dtype), fresh)


@pytest.fixture
def setup(tmp_path):
    served_cfg, lora_cfg = _configs()
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    _, base = placement.init_sharded(served_cfg, mesh, 0)
    root = tmp_path / "root"
    params_io.save_params(root / "base-v1", base)
    like = abstract_adapters(lora_cfg, mesh)
    return served_cfg, lora_cfg, mesh, base, root, WeightsLoader(str(root), LORA, like)


def _expected_target(w, a, b) -> np.ndarray:
    """W + scale · A B in float64 NumPy, for any of add_lora's layouts."""
    w, a, b = (np.asarray(x, np.float64) for x in (w, a, b))
    nb = a.ndim + b.ndim - 2 - w.ndim
    if nb:  # stacked experts: [E, in, r] x [E, r, out]
        delta = np.einsum("eir,ero->eio", a.reshape(a.shape[0], -1, a.shape[-1]),
                          b.reshape(b.shape[0], b.shape[1], -1))  # fmt: skip
    else:
        delta = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
    return w + LORA.scale * delta.reshape(w.shape)


def test_served_weights_are_base_plus_scaled_product(setup):
    served_cfg, lora_cfg, _, base, root, loader = setup
    adapters = _adapters(lora_cfg, seed=1)
    params_io.save_params(root / "v1", adapters)
    loaded = loader.load(str(root / "v1"), str(root / "base-v1"), base)
    flat_base = traverse_util.flatten_dict(base)
    flat_ad = traverse_util.flatten_dict(adapters)
    flat_out = traverse_util.flatten_dict(loaded.params)
    assert flat_out.keys() == flat_base.keys()
    targets = {(*p[:-1], p[-1][: -len("_lora_a")]) for p in flat_ad if p[-1].endswith("_lora_a")}
    assert any("router" in "/".join(map(str, p)) for p in targets) and len(targets) >= 6
    for path, w in flat_base.items():
        got = np.asarray(flat_out[path])
        if path in targets:
            a = flat_ad[(*path[:-1], path[-1] + "_lora_a")]
            b = flat_ad[(*path[:-1], path[-1] + "_lora_b")]
            want = _expected_target(w, a, b)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(path))
            assert not np.array_equal(got, np.asarray(w)), path
        else:  # norms, embeddings, lm_head: the base's, bit for bit
            np.testing.assert_array_equal(got, np.asarray(w), err_msg=str(path))
    # The merged model computes what the trainer's LoRA model computes.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, served_cfg.vocab_size, (2, 12)))
    graph_served, _ = nnx.split(nnx.eval_shape(lambda: Transformer(served_cfg, rngs=nnx.Rngs(0))))
    graph_lora, _ = nnx.split(nnx.eval_shape(lambda: Transformer(lora_cfg, rngs=nnx.Rngs(0))))
    served = nnx.merge(graph_served, loaded.params)(tokens)
    trained = nnx.merge(graph_lora, join_lora(base, adapters))(tokens)
    served = served[0] if isinstance(served, tuple) else served
    trained = trained[0] if isinstance(trained, tuple) else trained
    np.testing.assert_allclose(np.asarray(served), np.asarray(trained), rtol=1e-4, atol=1e-5)


def test_the_base_is_read_once_per_base_path(setup, tmp_path):
    _, lora_cfg, _, base, root, loader = setup
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(_adapters(lora_cfg, 0)))
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
    for v in (1, 2):
        params_io.save_params(root / f"v{v}", _adapters(lora_cfg, seed=v))
    first = loader.load(str(root / "v1"), str(root / "base-v1"), base)
    assert first.nbytes == base_bytes + adapter_bytes
    assert loader.kept_base == str((root / "base-v1").resolve())
    second = loader.load(str(root / "v2"), str(root / "base-v1"), first.params)
    assert second.nbytes == adapter_bytes  # only the adapters moved
    # Another base (a new trainer start): read, kept, and its non-target leaves served.
    other = jax.tree.map(lambda x: x + 1, base)
    params_io.save_params(root / "base-v3", other)
    third = loader.load(str(root / "v2"), str(root / "base-v3"), second.params)
    assert third.nbytes == base_bytes + adapter_bytes
    np.testing.assert_array_equal(
        np.asarray(third.params["embedding_vd"]),
        np.asarray(other["embedding_vd"]),
    )
    # A whole-params push drops the kept base.
    params_io.save_params(root / "full", base)
    full = loader.load(str(root / "full"), "", third.params)
    assert loader.kept_base == "" and full.nbytes == base_bytes


def test_refusals_name_the_problem(setup, tmp_path):
    served_cfg, lora_cfg, mesh, base, root, loader = setup
    params_io.save_params(root / "v1", _adapters(lora_cfg, seed=1))
    no_lora = WeightsLoader(str(root), LoRAConfig())
    with pytest.raises(CheckpointPathError, match="model.lora.rank = 0"):
        no_lora.load(str(root / "v1"), str(root / "base-v1"), base)
    outside = tmp_path / "outside"
    params_io.save_params(outside, base)
    with pytest.raises(CheckpointPathError, match="outside the checkpoint root"):
        loader.load(str(root / "v1"), str(outside), base)
    # Adapters of another rank, and adapters sent as whole params: refused, nothing kept.
    params_io.save_params(root / "r8", _adapters(served_cfg.replace(lora=LoRAConfig(rank=8)), 1))
    with pytest.raises(CheckpointPathError, match="cannot restore"):
        loader.load(str(root / "r8"), str(root / "base-v1"), base)
    with pytest.raises(CheckpointPathError, match="cannot restore"):
        loader.load(str(root / "v1"), "", base)
    assert loader.kept_base == ""


@pytest.mark.slow  # starts server processes
def test_a_server_serves_adapter_pushes_and_a_restart_reloads_them(server_factory, tmp_path):
    root = tmp_path / "root"
    overrides = [
        f"server.state_dir={tmp_path / 'state'}",
        f"server.checkpoint_root={root}",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.lora.targets=[attention,experts,router]",
    ]
    cfg = load_config(str(CONFIG), [*SHAPES, *overrides])
    served_cfg = cfg.serving_model
    assert served_cfg.lora.rank == 0  # the server serves merged weights
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    _, base = placement.init_sharded(served_cfg, mesh, 7)
    params_io.save_params(root / "base-v1", base)
    lora_cfg = served_cfg.replace(lora=cfg.model.lora)
    for v in (1, 2):
        params_io.save_params(root / f"v{v}", _adapters(lora_cfg, seed=v))
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(_adapters(lora_cfg, 0)))

    first = server_factory(overrides)
    stub = first.rollout_stub()

    def update(version: int, base_path: str) -> None:
        stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(
                version=version, checkpoint_path=str(root / f"v{version}"), base_path=base_path
            ),
            timeout=60,
        )

    update(1, str(root / "base-v1"))
    assert (stats(stub).push_bytes, stats(stub).push_bytes_total) == (
        base_bytes + adapter_bytes,
        base_bytes + adapter_bytes,
    )
    update(2, str(root / "base-v1"))
    s = stats(stub)
    assert (s.version, s.push_bytes) == (2, adapter_bytes)
    with pytest.raises(grpc.RpcError) as e:  # a base outside the root: refused, nothing changes
        stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(
                version=3, checkpoint_path=str(root / "v2"), base_path=str(tmp_path)
            ),
            timeout=60,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the checkpoint root" in e.value.details()
    first.kill()

    second = server_factory(overrides)  # reloads base-v1, then v2's adapters over it
    log = second.log()
    assert f"restored weights version 2 from {(root / 'v2').resolve()}" in log, log
    assert stats(second.rollout_stub()).version == 2
    assert second.stop() == 0
