"""The TPU kernels (splash attention, megablox gmm) in Pallas interpret mode on CPU, against the
reference paths: outputs and gradients, with right padding, GQA, and sharded over a mesh.

Tolerances: everything is float32. The kernels sum in another order than the references (online
softmax by 128-key blocks; tiled matmuls), so results differ by float32 rounding: relative
1e-5 on values of order 1-10 and absolute 1e-5 for entries near zero, as in test_attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.model import ModelConfig, Transformer
from sat_jax.model.attention import causal_attention, dense_attention, resolve_attention
from sat_jax.model.moe import Experts, dispatch_dense, dispatch_ragged, resolve_dispatch
from sat_jax.model.tpu_kernels import gmm_dispatch, gmm_row_tile, splash_attention, splash_block
from sat_jax.plan import topology
from sat_jax.sharding import MeshConfig, make_mesh

RTOL, ATOL = 1e-5, 1e-5


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _dense_causal(q, k, v, valid):
    t = q.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
    return dense_attention(q, k, v, allowed, jnp.float32)


def _assert_close_with_grads(f, ref, args, cot, argnums):
    """f(*args) == ref(*args), and so are their gradients of sum(out * cot) w.r.t. argnums."""

    def value_and_grads(fn):
        loss = lambda *a: (jnp.sum(fn(*a) * cot), fn(*a))
        return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)

    (_, got), got_grads = value_and_grads(f)
    (_, want), want_grads = value_and_grads(ref)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    for i, g, w in zip(argnums, got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"grad of argument {i}")


def _attention_inputs(b, t, g, r, h, lengths):
    q, k, v = _normal(0, (b, t, g, r, h)), _normal(1, (b, t, g, h)), _normal(2, (b, t, g, h))
    valid = jnp.asarray(np.arange(t)[None] < np.asarray(lengths)[:, None])
    return q, k, v, valid


@pytest.mark.parametrize(
    ("t", "block", "lengths"),
    # T padded to two 128-blocks; padding starting on both sides of the boundary; a row with a
    # single valid token.
    [(200, 100, [200, 130, 127, 1])],
)
def test_splash_equals_dense_attention_and_gradient(t, block, lengths):
    q, k, v, valid = _attention_inputs(
        len(lengths), t, 2, 2, 16, lengths
    )  # GQA: 2 query heads per KV
    splash = lambda q, k, v: splash_attention(q, k, v, valid, block=block)
    dense = lambda q, k, v: _dense_causal(q, k, v, valid)
    # Padded queries too: they see the valid keys before them, as on every path.
    _assert_close_with_grads(splash, dense, (q, k, v), _normal(3, q.shape), (0, 1, 2))


@pytest.mark.parametrize(
    "mesh_cfg",
    [
        MeshConfig(data=2, fsdp=2, tensor=2),  # KV heads over tensor
        MeshConfig(fsdp=2, tensor=4),  # tensor > KV heads: query heads per group over tensor
    ],
)
def test_splash_per_shard_equals_dense(mesh_cfg):
    q, k, v, valid = _attention_inputs(4, 60, 2, 4, 8, [60, 33, 1, 59])
    with jax.set_mesh(make_mesh(mesh_cfg)):
        got = jax.jit(lambda *a: causal_attention(*a, path="splash", block=64, dtype=jnp.float32))(
            q, k, v, valid
        )
    np.testing.assert_allclose(got, _dense_causal(q, k, v, valid), rtol=RTOL, atol=ATOL)


def test_tiles_are_lane_aligned_and_bounded():
    blocks = [splash_block(b, t) for b, t in [(5, 11), (512, 8704), (4096, 8704), (200, 1000)]]
    assert blocks == [128, 512, 512, 256]
    # Row tiles: E · tile <= M / 4 where possible, 128 at least, never past M rounded up.
    tiles = [gmm_row_tile(m, e) for m, e in [(66, 8), (32768, 128), (131072, 128), (1 << 20, 128)]]
    assert tiles == [128, 128, 256, 512]


def _moe_inputs(t=40, d=16, f=24, e=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    x = _normal(seed, (t, d))
    # Skewed routing: expert 0 takes most slots, some experts none.
    ids = np.stack(
        [rng.choice(e, k, replace=False, p=[0.5, 0.2, 0.2, 0.1] + [0] * (e - 4)) for _ in range(t)]
    )
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    shapes = [(e, d, f), (e, d, f), (e, f, d)]
    gate, up, down = (_normal(seed + 1 + i, s) / np.sqrt(s[1]) for i, s in enumerate(shapes))
    return x, jnp.asarray(ids, jnp.int32), weights, gate, up, down


def _dense_dispatch(x, ids, w, gate, up, down):
    return dispatch_dense(x, ids, w, Experts(gate_edf=gate, up_edf=up, down_efd=down))


def _ragged_dispatch(x, ids, w, gate, up, down):
    return dispatch_ragged(x, ids, w, Experts(gate_edf=gate, up_edf=up, down_efd=down))


def test_gmm_equals_ragged_dispatch_and_gradient():
    args = _moe_inputs()
    cot = _normal(9, args[0].shape)
    _assert_close_with_grads(gmm_dispatch, _ragged_dispatch, args, cot, (0, 2, 3, 4, 5))


@pytest.mark.parametrize(
    # Experts over "expert" (each shard computes only its groups), their width over "tensor"
    # (partial sums), tokens over "fsdp".
    "mesh_cfg",
    [MeshConfig(fsdp=2, expert=2, tensor=2)],
)
def test_gmm_per_shard_equals_dense(mesh_cfg):
    args = _moe_inputs(seed=1)
    cot = _normal(9, args[0].shape)
    with jax.set_mesh(make_mesh(mesh_cfg)):
        _assert_close_with_grads(gmm_dispatch, _dense_dispatch, args, cot, (0, 2, 3, 4, 5))


def test_model_with_tpu_kernels_equals_the_dense_reference():
    # Forward only: the kernels' gradients are checked above, and the model's backward through
    # interpret-mode kernels would triple this test's compile time.
    cfg = ModelConfig.preset("tiny", router_aux_loss_coef=0.01, attention_block=5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 11)))
    mask = jnp.asarray(np.arange(11)[None] < np.array([[11], [6], [2]]), jnp.float32)
    params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg"))))

    def run(attention, dispatch):
        model_cfg = cfg.replace(attention=attention, dispatch=dispatch)
        graphdef = nnx.graphdef(Transformer(model_cfg, rngs=nnx.Rngs(0)))

        def f(params):
            model = nnx.merge(graphdef, params)
            out = model.forward(tokens, mask_bt=mask)
            logp = model.target_logprobs(out.hidden_btd[:, :-1], tokens[:, 1:])
            return jnp.sum(logp * mask[:, 1:]) + out.aux_loss, out.hidden_btd, out.routing_btlk

        return jax.jit(f)(params)

    want_loss, want_h, want_routing = run("dense", "dense")
    loss, h, routing = run("splash", "gmm")
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(h[valid], want_h[valid], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(routing[valid], want_routing[valid])
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)


@pytest.mark.parametrize(
    ("platform", "attention", "dispatch"),
    [("tpu", "splash", "gmm"), ("gpu", "fused", "ragged"), ("cpu", "blockwise", "blocked")],
)
def test_auto_picks_the_kernels_on_tpu_only(platform, attention, dispatch):
    with jax.set_mesh(make_mesh(MeshConfig(fsdp=-1))):
        assert resolve_attention("auto", platform) == attention
        assert resolve_attention("blockwise", platform) == "blockwise"
        got = resolve_dispatch("auto", num_tokens=4096, num_experts=64, k=2, backend=platform)
        assert got == dispatch


def test_auto_keeps_xla_paths_on_tpu_without_a_mesh():
    # XLA cannot partition a Mosaic kernel over 8 devices by itself: no mesh, no kernel.
    assert jax.device_count() > 1
    assert resolve_attention("auto", "tpu") == "blockwise"
    assert resolve_dispatch("auto", num_tokens=64, num_experts=8, k=2, backend="tpu") == "ragged"


@pytest.mark.parametrize(
    ("devices", "attention", "dispatch"), [(4, "blockwise", "ragged"), (1, "splash", "gmm")]
)
def test_the_plan_traces_for_the_targets_device_count(devices, attention, dispatch):
    """`sat_jax.plan --serve` compiles a multi-chip server, traced without a mesh, on a host whose
    own device count differs: its "auto" paths must be what that server picks on its TPUs (no
    kernel over 4 chips without a mesh; the kernels on one chip)."""
    with topology.traced_for("tpu", devices):
        assert resolve_attention("auto") == attention
        assert resolve_dispatch("auto", num_tokens=64, num_experts=8, k=2) == dispatch
