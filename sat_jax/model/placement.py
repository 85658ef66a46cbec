"""The policy model placed on a mesh: its abstract state and its sharded initialization.

``abstract_model`` gives the ``Transformer``'s shapes without allocating anything;
``init_sharded`` initializes it directly into the shardings that ``sat_jax.sharding``'s rules give
its parameters (``sharding.param_shardings``), so nothing lands whole on one device first.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from sat_jax import sharding
from sat_jax.model.config import ModelConfig
from sat_jax.model.transformer import Transformer


def abstract_model(model_cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, abstract state)`` of a ``Transformer`` via ``nnx.eval_shape`` (no allocation)."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def init_sharded(model_cfg: Any, mesh: Mesh, rng: int | jax.Array = 0) -> tuple[nnx.GraphDef, dict]:
    """Initializes a ``Transformer`` directly into its shardings on ``mesh``.

    ``nnx.eval_shape`` gives the abstract state, the rules give its shardings, and the init runs
    under ``jax.jit(..., out_shardings=...)``, so no parameter is ever materialized whole on one
    device. The values equal ``Transformer(model_cfg, rngs=nnx.Rngs(rng))``.

    Args:
      model_cfg: a ``sat_jax.model.ModelConfig``.
      mesh: the device mesh.
      rng: an int seed or a PRNG key.

    Returns:
      ``(graphdef, params)`` with ``params`` a plain nested dict of sharded arrays;
      ``nnx.merge(graphdef, params)`` rebuilds the module.
    """
    graphdef, abstract = abstract_model(model_cfg)
    shardings = sharding.param_shardings(abstract, mesh)
    key = jax.random.key(rng) if isinstance(rng, int) else rng

    def init(key: jax.Array) -> dict:
        return nnx.to_pure_dict(nnx.state(Transformer(model_cfg, rngs=nnx.Rngs(key))))

    return graphdef, jax.jit(init, out_shardings=shardings)(key)
