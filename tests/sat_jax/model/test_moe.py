"""The MoE layer: routing, replay (R3), dispatch paths, aux loss and load, against NumPy float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_jax.model import moe as moe_lib
from sat_jax.model.moe import MoE, balance_loss, expert_load, resolve_dispatch, route

D, E, K, F = 16, 8, 2, 12
PATHS = ("dense", "ragged", "blocked")
_blocked_jit = jax.jit(moe_lib.dispatch_blocked, static_argnames="block_size")
_dense_jit = jax.jit(moe_lib.dispatch_dense)


# Test inputs come from NumPy and params from the RBG PRNG: both skip the slow XLA compile of
# threefry random ops for every new shape (it dominated this suite's run time).
def _rngs():
    return nnx.Rngs(jax.random.key(0, impl="rbg"))


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _make_moe(norm_topk_prob=True, num_experts=E, k=K):
    return MoE(
        d_model=D,
        num_experts=num_experts,
        k=k,
        expert_dim=F,
        norm_topk_prob=norm_topk_prob,
        dispatch="auto",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs=_rngs(),
    )


def _x(b=2, t=9, seed=1):
    return _normal(seed, (b, t, D))


def _np_moe(layer: MoE, x_btd, *, replay_btk=None):
    """The layer from its equations: p = softmax(x W_r); S = top-k(p) or the replayed set;
    w_e = p_e (/ sum_{S} p when norm_topk_prob); y = sum_{e in S} w_e SwiGLU_e(x)."""
    p = lambda v: np.asarray(v[...], np.float64)
    x = np.asarray(x_btd, np.float64).reshape(-1, D)
    logits = x @ p(layer.w_router_de)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        if replay_btk is None:
            chosen = np.argsort(-probs[t], kind="stable")[: layer.k]
        else:
            chosen = np.asarray(replay_btk).reshape(-1, layer.k)[t]
        w = probs[t, chosen]
        if layer.norm_topk_prob:
            w = w / w.sum()
        for e, we in zip(chosen, w, strict=True):
            g, u = x[t] @ p(layer.w_gate_edf)[e], x[t] @ p(layer.w_up_edf)[e]
            y[t] += we * ((g / (1 + np.exp(-g)) * u) @ p(layer.w_down_efd)[e])
    return y.reshape(x_btd.shape)


@nnx.jit(static_argnames=("dispatch",))
def _apply(layer, x, replay=None, dispatch=None):
    return layer(x, mask_bt=jnp.ones(x.shape[:2], bool), replay_ids_btk=replay, dispatch=dispatch)


@pytest.mark.parametrize(
    "path,norm_topk_prob",
    [
        ("dense", True),
        ("ragged", True),
        ("blocked", True),
        ("dense", False),
    ],
)
def test_matches_numpy_reference(path, norm_topk_prob):
    layer = _make_moe(norm_topk_prob)
    x = _x()
    out = _apply(layer, x, dispatch=path)
    np.testing.assert_allclose(out.y_btd, _np_moe(layer, x), rtol=1e-5, atol=1e-5)


def test_jit_equals_eager():
    layer = _make_moe()
    x = _x()
    eager = layer(x, mask_bt=jnp.ones(x.shape[:2], bool))
    jitted = _apply(layer, x)
    np.testing.assert_allclose(jitted.y_btd, eager.y_btd, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(jitted.topk_ids_btk, eager.topk_ids_btk)


@pytest.mark.parametrize("path", PATHS)
def test_replay_matches_numpy_reference(path):
    layer = _make_moe()
    x = _x()
    replay = jnp.asarray(np.random.default_rng(7).integers(0, E, (2, 9, K)), jnp.uint8)
    replay = replay.at[..., 1].set((replay[..., 0] + 3) % E)  # distinct experts per token
    out = _apply(layer, x, replay=replay, dispatch=path)
    np.testing.assert_allclose(
        out.y_btd, _np_moe(layer, x, replay_btk=replay), rtol=1e-5, atol=1e-5
    )


def test_topk_weights_renormalized_only_when_asked():
    logits = _normal(0, (5, E))
    on = route(logits, k=K, norm_topk_prob=True)
    off = route(logits, k=K, norm_topk_prob=False)
    np.testing.assert_allclose(on.weights_tk.sum(-1), 1.0, rtol=1e-6)
    assert np.all(off.weights_tk.sum(-1) < 1.0)
    np.testing.assert_array_equal(on.ids_tk, off.ids_tk)
    np.testing.assert_allclose(off.weights_tk, jnp.take_along_axis(off.probs_te, off.ids_tk, -1))


def test_replaying_own_routing_changes_nothing():
    layer = _make_moe()
    x = _x()
    own = _apply(layer, x)
    replayed = _apply(layer, x, replay=own.topk_ids_btk.astype(jnp.uint8))
    np.testing.assert_array_equal(replayed.y_btd, own.y_btd)


def test_replay_mask_routes_unmasked_tokens_by_the_live_top_k():
    logits = _normal(5, (4, E))
    live = route(logits, k=2, norm_topk_prob=True)
    recorded = (live.ids_tk + 1) % E
    on = jnp.array([True, False, True, False])
    r = route(logits, k=2, norm_topk_prob=True, replay_ids_tk=recorded, replay_mask_t=on)
    replayed = route(logits, k=2, norm_topk_prob=True, replay_ids_tk=recorded)
    for got, want_on, want_off in (
        (r.ids_tk, replayed.ids_tk, live.ids_tk),
        (r.weights_tk, replayed.weights_tk, live.weights_tk),
    ):
        np.testing.assert_array_equal(got[on], want_on[on])
        np.testing.assert_array_equal(got[~on], want_off[~on])  # exactly the live weights


def test_replay_weights_come_from_dense_softmax():
    logits = jnp.array([[3.0, 2.0, 1.0, 0.0]])
    r = route(logits, k=2, norm_topk_prob=False, replay_ids_tk=jnp.array([[2, 3]]))
    probs = np.exp([3.0, 2.0, 1.0, 0.0]) / np.exp([3.0, 2.0, 1.0, 0.0]).sum()
    np.testing.assert_allclose(r.weights_tk, [probs[2:]], rtol=1e-6)
    r = route(logits, k=2, norm_topk_prob=True, replay_ids_tk=jnp.array([[2, 3]]))
    np.testing.assert_allclose(r.weights_tk, [probs[2:] / probs[2:].sum()], rtol=1e-6)


def _grads(layer, x, path, replay=None):
    graphdef, params = nnx.split(layer)
    cot = _normal(3, x.shape)

    def loss(params, x):
        out = nnx.merge(graphdef, params)(
            x, mask_bt=jnp.ones(x.shape[:2], bool), replay_ids_btk=replay, dispatch=path
        )
        return jnp.sum(out.y_btd * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


@pytest.mark.parametrize("path", ["ragged", "blocked"])
def test_sparse_paths_match_dense_forward_and_grad(path):
    layer = _make_moe()
    x = _x(t=33)
    want_v, want_g = _grads(layer, x, "dense")
    got_v, got_g = _grads(layer, x, path)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_replay_of_other_ids_reaches_the_router():
    layer = _make_moe()
    x = _x()
    other = (_apply(layer, x).topk_ids_btk + 1) % E
    _, (g_params, _) = _grads(layer, x, "dense", replay=other)
    assert float(jnp.abs(g_params["w_router_de"][...]).max()) > 0


@pytest.mark.parametrize("block_size", [1, 3, 8, 64])
def test_blocked_handles_any_block_size_and_skew(block_size):
    x_td = _normal(4, (13, D)).astype(jnp.float32)
    ids = jnp.zeros((13, K), jnp.int32).at[:, 1].set(5)  # every token on experts 0 and 5
    weights = jnp.full((13, K), 0.5)
    layer = _make_moe()
    experts = moe_lib.Experts(
        gate_edf=layer.w_gate_edf[...], up_edf=layer.w_up_edf[...], down_efd=layer.w_down_efd[...]
    )
    np.testing.assert_allclose(
        _blocked_jit(x_td, ids, weights, experts, block_size=block_size),
        _dense_jit(x_td, ids, weights, experts),
        rtol=1e-5,
        atol=1e-5,
    )


def test_balance_loss_and_load_match_reference():
    probs = jax.nn.softmax(_normal(5, (6, 4)))
    ids = jnp.array([[0, 1], [0, 2], [3, 0], [1, 2], [0, 1], [2, 3]])
    mask = jnp.array([1, 1, 1, 1, 0, 0], bool)
    p = np.asarray(probs, np.float64)[:4]
    f = np.array([np.mean([e in row for row in np.asarray(ids)[:4]]) for e in range(4)])
    np.testing.assert_allclose(balance_loss(probs, ids, mask), 4 * np.sum(f * p.mean(0)), rtol=1e-6)
    np.testing.assert_allclose(expert_load(ids, mask, 4), [3 / 8, 2 / 8, 2 / 8, 1 / 8])


def test_balance_loss_is_k_at_uniform_routing_and_differentiable():
    probs = jnp.full((4, 4), 0.25)
    ids = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(balance_loss(probs, ids, jnp.ones(4, bool))) == pytest.approx(2.0)
    layer = _make_moe()
    graphdef, params = nnx.split(layer)
    x = _x()

    def loss(params):
        return nnx.merge(graphdef, params)(x, mask_bt=jnp.ones(x.shape[:2], bool)).balance_loss

    value, grads = jax.value_and_grad(loss)(params)
    assert np.isfinite(value)
    assert float(jnp.abs(grads["w_router_de"][...]).max()) > 0


@pytest.mark.parametrize(
    "tokens,experts,k,backend,want",
    [
        (4096, 128, 8, "gpu", "ragged"),
        (4096, 128, 8, "tpu", "ragged"),  # no mesh, 8 devices: see test_tpu_kernels for "gmm"
        (4096, 2, 2, "cpu", "dense"),
        (4096, 64, 2, "cpu", "blocked"),
        (2, 64, 2, "cpu", "dense"),  # decoding: padded blocks would cost more than every expert
    ],
)
def test_auto_dispatch_choice(tokens, experts, k, backend, want):
    assert (
        resolve_dispatch("auto", num_tokens=tokens, num_experts=experts, k=k, backend=backend)
        == want
    )
    assert (
        resolve_dispatch("ragged", num_tokens=tokens, num_experts=experts, k=k, backend=backend)
        == "ragged"
    )


@settings(max_examples=25, deadline=None)
@given(
    ids=st.lists(st.integers(0, E - 1), min_size=13 * K, max_size=13 * K),
    block_size=st.sampled_from([None, 2, 5]),
)
def test_blocked_matches_dense_for_any_routing(ids, block_size):
    # Fixed shapes, so each block size compiles once; hypothesis varies the (skewed) routing.
    x_td = _normal(4, (13, D))
    ids_tk = jnp.array(ids, jnp.int32).reshape(13, K)
    weights = jnp.asarray(np.random.default_rng(5).uniform(size=(13, K)), jnp.float32)
    layer = _make_moe()
    experts = moe_lib.Experts(
        gate_edf=layer.w_gate_edf[...], up_edf=layer.w_up_edf[...], down_efd=layer.w_down_efd[...]
    )
    np.testing.assert_allclose(
        _blocked_jit(x_td, ids_tk, weights, experts, block_size=block_size),
        _dense_jit(x_td, ids_tk, weights, experts),
        rtol=1e-5,
        atol=1e-5,
    )
