"""Memory plan of a preset or an experiment config on a mesh, from shapes alone (no allocation).

    python -m sat_jax.plan --preset qwen3_30b_a3b --mesh fsdp=64
    python -m sat_jax.plan --config configs/qwen3_30b_a3b_gsm8k.yaml   # its model and train.mesh
    python -m sat_jax.plan --preset small --mesh fsdp=8 --batch 8 --seq-len 2048 --compile \
        --set remat=layer   # with XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU

prints total and active parameter counts and the per-device bytes of parameters, gradients and the
optimizer state. Shapes come from ``nnx.eval_shape`` (the optimizer state's shapes and dtypes from
``jax.eval_shape`` of the trainer's real ``optimizer.init``: Adam's m and v are float32 whatever the
parameter dtype, ``sat_jax.optimizer``) and shardings from the rules in
``sat_jax.parallel.sharding`` applied to the mesh's axis sizes, so the numbers are exactly what
``init_train_state`` would place on each device (per-device bytes of a parameter = its bytes divided
by the product of the mesh axes its ``PartitionSpec`` shards it over). With ``--compile`` it also
lowers and compiles the real train step (the trainer's optimizer, the default SAT loss) for a
[batch, seq-len] batch on the mesh's devices and prints XLA's memory analysis of it:
``compiled temp bytes per device: N`` (activations and other temporaries).

Active parameters: every parameter except the routed experts' weights (those with both an "exp" and
an "mlp" axis), plus K/E of those.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from jax.sharding import PartitionSpec

from sat_jax import objectives, train_step
from sat_jax.experiment import TrainConfig, load_config
from sat_jax.model import ModelConfig
from sat_jax.parallel import sharding


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Parameter counts and per-device bytes of one model config on one mesh.

    Attributes:
      mesh: resolved axis sizes.
      total_params: all parameters.
      active_params: parameters one token uses (non-expert + K/E of the expert weights).
      param_bytes: per-device bytes of the parameters (in ``param_dtype``).
      grad_bytes: per-device bytes of the gradients (same dtype and sharding as the params).
      adam_bytes: per-device bytes of the optimizer state (Adam's m and v, sharded like the
        params, and its replicated counters), in the dtypes its ``init`` gives.
    """

    mesh: dict[str, int]
    total_params: int
    active_params: int
    param_bytes: int
    grad_bytes: int
    adam_bytes: int

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def total_bytes(self) -> int:
        """Per-device bytes of params, gradients and Adam state (activations excluded)."""
        return self.param_bytes + self.grad_bytes + self.adam_bytes


def plan_memory(
    model_cfg: ModelConfig,
    mesh_cfg: sharding.MeshConfig,
    num_devices: int | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> MemoryPlan:
    """Counts parameters and per-device bytes of ``model_cfg`` sharded on ``mesh_cfg``.

    Args:
      model_cfg: the model config.
      mesh_cfg: mesh axis sizes; a ``-1`` axis needs ``num_devices``.
      num_devices: total devices; default the product of the (explicit) axis sizes.
      optimizer: whose state to count; default the trainer's (``TrainConfig().optimizer.make()``).

    Returns:
      A ``MemoryPlan``.
    """
    sizes = {name: getattr(mesh_cfg, name) for name in sharding.MESH_AXES}
    if num_devices is None:
        if -1 in sizes.values():
            raise ValueError("a mesh with a -1 axis needs num_devices (--devices)")
        num_devices = math.prod(sizes.values())
    mesh = sharding.abstract_mesh(mesh_cfg, num_devices)
    _, abstract = sharding.abstract_model(model_cfg)
    specs = dict(nnx.to_flat_state(nnx.State(sharding.param_specs(abstract, mesh))))
    total = expert = 0
    param_bytes = 0
    for path, var in nnx.to_flat_state(abstract):
        value = var.get_value()
        numel = math.prod(value.shape)
        shards = _num_shards(specs[path], dict(mesh.shape))
        total += numel
        logical = var.get_metadata().get("out_sharding") or ()
        if "exp" in logical and "mlp" in logical:
            expert += numel
        param_bytes += numel * np.dtype(value.dtype).itemsize // shards
    k, e = model_cfg.num_experts_per_tok, max(model_cfg.num_experts, 1)
    return MemoryPlan(
        mesh=dict(mesh.shape),
        total_params=total,
        active_params=total - expert + expert * k // e,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        adam_bytes=_optimizer_bytes(optimizer or TrainConfig().optimizer.make(), abstract, mesh),
    )


def _optimizer_bytes(
    optimizer: optax.GradientTransformation, abstract: nnx.State, mesh: jax.sharding.AbstractMesh
) -> int:
    """Per-device bytes of ``optimizer.init``'s state (``jax.eval_shape``): param-like leaves
    sharded like their params, the rest replicated (as ``train_step.train_state_shardings``)."""
    is_spec = lambda x: isinstance(x, PartitionSpec)
    state = jax.eval_shape(optimizer.init, nnx.to_pure_dict(abstract))
    specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        state,
        sharding.param_specs(abstract, mesh),
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=is_spec,
    )
    sizes = dict(mesh.shape)
    return sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize // _num_shards(spec, sizes)
        for x, spec in zip(
            jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=is_spec), strict=True
        )
    )


def _num_shards(spec: object, sizes: dict[str, int]) -> int:
    out = 1
    for entry in spec:
        for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            out *= sizes[axis]
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:,.3f} GiB"


def format_plan(name: str, plan: MemoryPlan) -> str:
    """A short human-readable table of ``plan``."""
    mesh = ", ".join(f"{a}={s}" for a, s in plan.mesh.items())
    rows = [
        f"model            {name}",
        f"mesh             {mesh} ({plan.num_devices} devices)",
        f"total params     {plan.total_params:,} ({plan.total_params / 1e9:.2f} B)",
        f"active params    {plan.active_params:,} ({plan.active_params / 1e9:.2f} B)",
        "per device:",
        f"  params         {_gib(plan.param_bytes)}",
        f"  gradients      {_gib(plan.grad_bytes)}",
        f"  optimizer      {_gib(plan.adam_bytes)}",
        f"  total          {_gib(plan.total_bytes)}  (activations not included)",
    ]
    return "\n".join(rows)


def compiled_temp_bytes(
    model_cfg: ModelConfig,
    mesh_cfg: sharding.MeshConfig,
    batch: int,
    seq_len: int,
    *,
    microbatches: int = 1,
    optimizer: optax.GradientTransformation | None = None,
) -> int:
    """Per-device temporary bytes of the compiled train step, from XLA's memory analysis.

    Lowers ``train_step.make_train_step`` (``optimizer``, default the trainer's; SAT on, no
    routing replay) for a [batch,
    seq_len] batch on a mesh of the first devices (all of them for a -1 axis), from shapes only (nothing is allocated
    besides what compilation needs).
    """
    sizes = [getattr(mesh_cfg, name) for name in sharding.MESH_AXES]
    count = jax.device_count() if -1 in sizes else math.prod(sizes)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:count])
    optimizer = optimizer or TrainConfig().optimizer.make()
    loss_cfg = objectives.PolicyLossConfig(sat=objectives.SATConfig())
    step = train_step.make_train_step(
        model_cfg, optimizer, loss_cfg, mesh, routing_replay=False, microbatches=microbatches
    )
    _, abstract = sharding.abstract_model(model_cfg)
    params = nnx.to_pure_dict(abstract)
    state = train_step.TrainState(
        params=params,
        opt_state=jax.eval_shape(optimizer.init, params),
        step=jax.ShapeDtypeStruct((), jnp.int32),
    )
    with_sharding = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    state = jax.tree.map(
        with_sharding, state, train_step.train_state_shardings(model_cfg, optimizer, mesh)
    )
    f32 = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)
    data = train_step.TrainBatch(
        tokens=jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
        loss_mask=f32,
        behavior_logp=f32,
        advantages=f32,
    )
    data = jax.tree.map(with_sharding, data, train_step.batch_shardings(data, mesh))
    return step.lower(state, data).compile().memory_analysis().temp_size_in_bytes


def _model_config(preset: str, settings: Sequence[str]) -> ModelConfig:
    overrides = {}
    for item in settings:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r} is not field=value")
        overrides[key.strip()] = yaml.safe_load(text)
    return ModelConfig.preset(preset, **overrides)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sat_jax.plan", description=__doc__.split("\n")[0]
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a ModelConfig preset name")
    source.add_argument("--config", help="an experiment YAML: its model and train.mesh")
    parser.add_argument(
        "--mesh",
        help="axis sizes, e.g. fsdp=64 or data=2,fsdp=32 (default with --config: train.mesh)",
    )
    parser.add_argument("--devices", type=int, default=None, help="device count for a -1 axis")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of --config")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="ModelConfig override"
    )
    parser.add_argument("--compile", action="store_true", help="compile the train step too")
    parser.add_argument("--batch", type=int, default=None, help="B, rows of the batch")
    parser.add_argument("--seq-len", type=int, default=None, help="T, tokens per row")
    parser.add_argument("--microbatches", type=int, default=1, help="gradient accumulation k")
    return parser.parse_intermixed_args(argv)


def _configs(args: argparse.Namespace) -> tuple[str, ModelConfig, sharding.MeshConfig, TrainConfig]:
    """(name, model, mesh, train config) from --preset/--set/--mesh or --config and overrides."""
    if args.config is None:
        if args.mesh is None or args.overrides:
            raise ValueError("--preset needs --mesh and takes no key=value overrides")
        model_cfg = _model_config(args.preset, args.set)
        return args.preset, model_cfg, sharding.MeshConfig.parse(args.mesh), TrainConfig()
    if args.set:
        raise ValueError("--set is for --preset; give a --config model.FIELD=VALUE instead")
    cfg = load_config(args.config, args.overrides)
    mesh_cfg = sharding.MeshConfig.parse(args.mesh) if args.mesh else cfg.train.mesh
    return cfg.name, cfg.model, mesh_cfg, cfg.train


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parse(argv)
    try:
        name, model_cfg, mesh_cfg, train_cfg = _configs(args)
        optimizer = train_cfg.optimizer.make()
        plan = plan_memory(model_cfg, mesh_cfg, args.devices, optimizer)
        if args.compile and (args.batch is None or args.seq_len is None):
            raise ValueError("--compile needs --batch and --seq-len")
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(name, plan))
    if args.compile:
        try:
            temp = compiled_temp_bytes(
                model_cfg,
                mesh_cfg,
                args.batch,
                args.seq_len,
                microbatches=args.microbatches,
                optimizer=optimizer,
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(
            f"batch            [{args.batch}, {args.seq_len}], {args.microbatches} microbatch(es)"
        )
        print(f"compiled temp bytes per device: {temp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
