"""sat_jax.optimizer: Adam's moments are float32 whatever the parameter dtype, and for float32
params the wrapper changes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sat_jax.experiment import TrainConfig
from sat_jax.optimizer import float32_state


def test_bfloat16_params_keep_float32_moments_and_their_own_dtype():
    opt = TrainConfig(learning_rate=0.1).optimizer.make()
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
