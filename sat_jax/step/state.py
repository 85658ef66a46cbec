"""The train state: what a step updates, its shardings, and how it is made (from given params,
initialized, or as shapes for a restore or an ahead-of-time compile).

Init goes through ``jax.eval_shape`` → shardings → a jitted init with those out shardings, so
nothing lands whole on one device first.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sat_jax import sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.model.lora import join_lora, split_lora


@flax.struct.dataclass
class TrainState:
    """Everything a step updates; a plain pytree that orbax saves as is.

    Attributes:
      params: nested dict of the trained parameter arrays (``nnx.State.to_pure_dict()`` layout):
        all of the model's, or with LoRA (``ModelConfig.lora.rank`` > 0) only its adapters.
      opt_state: the optax state for ``params``.
      step: int32 scalar, the number of updates applied (skipped steps do not count).
      frozen: with LoRA, the base params (every non-adapter leaf, in their param dtype and
        shardings), which the step reads and returns unchanged; ``join_lora(frozen,
        params)`` is the whole model. None without LoRA.
    """

    params: Any
    opt_state: optax.OptState
    step: jax.Array
    frozen: Any = None

    @property
    def model_params(self) -> Any:
        """The whole model's params: ``params``, joined with ``frozen`` under LoRA."""
        return whole_params(self.frozen, self.params)


def whole_params(frozen: Any, params: Any) -> Any:
    """The whole model's params from the trained ones and, under LoRA, the frozen base."""
    return params if frozen is None else join_lora(frozen, params)


def train_state_shardings(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """A ``TrainState`` of ``NamedSharding``: params (and with LoRA the frozen base) by the rules,
    optimizer moments like their params, scalars (step, counts) replicated. Also the target for
    an orbax restore."""
    _, abstract = placement.abstract_model(model_cfg)
    frozen_sh, param_sh = _trained(model_cfg, sharding.param_shardings(abstract, mesh))
    replicated = NamedSharding(mesh, PartitionSpec())
    _, trained = _trained(model_cfg, nnx.to_pure_dict(abstract))
    abstract_opt = jax.eval_shape(optimizer.init, trained)
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sh: sh,
        abstract_opt,
        param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return TrainState(params=param_sh, opt_state=opt_sh, step=replicated, frozen=frozen_sh)


def _trained(model_cfg: ModelConfig, tree: Any) -> tuple[Any, Any]:
    """``(frozen, trained)`` parts of a params-layout tree: ``(None, tree)`` without LoRA, else
    ``split_lora``'s (base, adapters)."""
    if not model_cfg.lora.rank:
        return None, tree
    return split_lora(tree)


def abstract_train_state(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """The ``TrainState`` of ``create_train_state`` as ``ShapeDtypeStruct``s carrying their
    shardings (nothing allocated): the target of a restore or an ahead-of-time compile."""
    _, abstract = placement.abstract_model(model_cfg)
    frozen, params = _trained(model_cfg, nnx.to_pure_dict(abstract))
    shapes = TrainState(
        params=params,
        opt_state=jax.eval_shape(optimizer.init, params),
        step=jax.ShapeDtypeStruct((), jnp.int32),
        frozen=frozen,
    )
    with_sharding = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    return jax.tree.map(with_sharding, shapes, train_state_shardings(model_cfg, optimizer, mesh))


def create_train_state(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh, params: Any
) -> TrainState:
    """A step-0 ``TrainState`` from given params (e.g. an HF import), placed in their shardings.

    ``params`` is the whole model's tree (``nnx.to_pure_dict`` layout). With LoRA it must hold
    the adapters too (``placement.init_sharded`` and ``hf.load_params`` make them): the adapters
    become ``params`` (the optimizer state covers only them) and the rest ``frozen``, kept in
    its param dtype. ``params`` may be host arrays or arrays on other devices; on several
    processes every process must pass the same values.

    Raises:
      ValueError: LoRA is on and ``params`` has no adapters.
    """
    shardings = train_state_shardings(model_cfg, optimizer, mesh)
    frozen, params = _trained(model_cfg, params)
    if frozen is not None and not params:
        raise ValueError(
            "model.lora.rank > 0 but the params have no LoRA adapters; make them with "
            "placement.init_sharded or hf.load_params under the LoRA config (or init_lora)"
        )
    params = jax.device_put(params, shardings.params)
    frozen = None if frozen is None else jax.device_put(frozen, shardings.frozen)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(params=params, opt_state=opt_state, step=step, frozen=frozen)


def init_train_state(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rng: int | jax.Array = 0,
) -> TrainState:
    """Initializes params (``placement.init_sharded``, adapters included under LoRA) and the
    optimizer state in their shardings."""
    _, params = placement.init_sharded(model_cfg, mesh, rng)
    return create_train_state(model_cfg, optimizer, mesh, params)
