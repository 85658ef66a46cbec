"""Random-parameter models for tests: drawn by NumPy from the abstract model's shapes (eager Flax
init of even the tiny preset takes ~10 s on this machine)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax.model import ModelConfig, Transformer


def random_params(cfg: ModelConfig, seed: int, scale: float = 0.3) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, pure-dict params) of ``Transformer(cfg)``, every weight N(0, scale²) from a
    NumPy generator seeded with ``seed``."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * scale),
        nnx.to_pure_dict(abstract),
    )
    return graphdef, params
