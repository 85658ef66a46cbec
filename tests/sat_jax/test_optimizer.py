"""sat_jax.optimizer: Adam's moments are float32 whatever the parameter dtype, and for float32
params the wrapper changes nothing; `OptimizerConfig.make()` follows its schedule and clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sat_jax.optimizer import OptimizerConfig, float32_state


def test_bfloat16_params_keep_float32_moments_and_their_own_dtype():
    opt = OptimizerConfig(learning_rate=0.1).make(100)
    params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.bfloat16)}
    state = opt.init(params)
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    grads = {"w": jnp.asarray([0.5, 0.25, -1.0], jnp.bfloat16)}
    updates, state = opt.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert new["w"].dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state) if x.ndim)
    # A step against the gradient's sign (Adam's first step is lr * sign(g)).
    np.testing.assert_array_equal(np.sign(np.asarray(new["w"] - params["w"], np.float32)),
                                  [-1.0, -1.0, 1.0])  # fmt: skip


def test_float32_params_are_unchanged_by_the_wrapper():
    inner = optax.adamw(0.01, weight_decay=0.1)
    wrapped = float32_state(inner)
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=5), jnp.float32)}
    grads = {"w": jnp.asarray(np.random.default_rng(1).normal(size=5), jnp.float32)}
    s1, s2 = inner.init(params), wrapped.init(params)
    for _ in range(3):
        u1, s1 = inner.update(grads, s1, params)
        u2, s2 = wrapped.update(grads, s2, params)
        np.testing.assert_array_equal(np.asarray(u1["w"]), np.asarray(u2["w"]))


def _part(**overrides) -> OptimizerConfig:
    return OptimizerConfig(learning_rate=0.5, **overrides)


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("constant", {0: 0.0, 1: 0.25, 2: 0.5, 6: 0.5, 10: 0.5}),
        ("linear", {0: 0.0, 2: 0.5, 6: 0.25, 10: 0.0}),
        ("cosine", {0: 0.0, 2: 0.5, 6: 0.25, 10: 0.0}),
    ],
)
def test_schedule_warms_up_from_0_then_decays_to_0_over_the_run(schedule, expected):
    # Warm-up over 2 of 10 steps; the decay spans the other 8 (halfway at step 6).
    lr = _part(lr_schedule=schedule, lr_warmup_steps=2).schedule(10)
    for step, value in expected.items():
        assert float(lr(step)) == pytest.approx(value, abs=1e-7), (schedule, step)


def test_grad_clip_rescales_only_gradients_over_the_threshold():
    params = {"w": jnp.zeros(2, jnp.float32)}
    small = [{"w": jnp.asarray([0.3, 0.4])}, {"w": jnp.asarray([0.06, -0.08])}]
    large = [{"w": jnp.asarray([30.0, 40.0])}, {"w": jnp.asarray([0.06, -0.08])}]

    def updates(part: OptimizerConfig, grads: list) -> np.ndarray:
        opt = part.make(10)
        state = opt.init(params)
        for g in grads:
            u, state = opt.update(g, state, params)
        return np.asarray(u["w"])

    clipped, unclipped = _part(grad_clip=1.0), _part(grad_clip=0.0)
    # Norm 0.5 <= 1: clipping is the identity; norm 50 > 1 is scaled to 1, which changes Adam's
    # second update (its moments remember the first gradient's size).
    np.testing.assert_array_equal(updates(clipped, small), updates(unclipped, small))
    assert not np.allclose(updates(clipped, large), updates(unclipped, large))
