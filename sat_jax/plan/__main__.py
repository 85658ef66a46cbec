"""``python -m sat_jax.plan``: the command line of the memory and compile plans (``memory``).

The only code of the plan that reads the command line and the process environment: the flags, the
overrides (``--config CFG k=v ...``; with ``--preset`` they set the preset's ``ModelConfig`` fields,
``FIELD=VALUE`` or ``lora.FIELD=VALUE``), and the libtpu settings of a ``--topology`` compile
(``topology.offline_libtpu_env``). See ``sat_jax.plan.memory`` for what it prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence

import jax
import yaml

from sat_jax import sharding
from sat_jax.config import TrainConfig
from sat_jax.experiment import ExperimentConfig, load_config
from sat_jax.model import ModelConfig
from sat_jax.model.config import LoRAConfig
from sat_jax.plan import lengths, memory, topology
from sat_jax.step import StepConfig, step_config


def _offline_libtpu(name: str) -> None:
    """Checks that libtpu is installed and sets, where unset, the environment that keeps it off the
    network and off its lockfile (``topology.offline_libtpu_env``), before libtpu first loads."""
    if not topology.libtpu_installed(os.environ.get("TPU_LIBRARY_PATH", "")):
        raise topology.LibtpuMissing(
            "libtpu is not installed: compiling for a TPU topology needs it "
            "(pip install -e '.[tpu]', or put the libtpu package on PYTHONPATH)"
        )
    for key, value in topology.offline_libtpu_env(name).items():
        os.environ.setdefault(key, value)


def _model_config(preset: str, settings: Sequence[str]) -> ModelConfig:
    """The preset with ``FIELD=VALUE`` overrides of its ``ModelConfig`` (``model.FIELD`` too);
    ``lora.FIELD=VALUE`` sets a ``LoRAConfig`` field."""
    overrides, lora = {}, {}
    for item in settings:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        key, value = key.strip().removeprefix("model."), yaml.safe_load(text)
        if key.startswith("lora."):
            lora[key.removeprefix("lora.")] = tuple(value) if isinstance(value, list) else value
        else:
            overrides[key] = value
    if lora:
        overrides["lora"] = LoRAConfig(**lora)
    return ModelConfig.preset(preset, **overrides)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sat_jax.plan", description=memory.__doc__.split("\n")[0]
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a ModelConfig preset name")
    source.add_argument("--config", help="an experiment YAML: its model and train.mesh")
    parser.add_argument(
        "--mesh",
        help="axis sizes, e.g. fsdp=64 or data=2,fsdp=32 (default with --config: train.mesh, "
        "or server.mesh with --serve)",
    )
    parser.add_argument("--devices", type=int, default=None, help="device count for a -1 axis")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted key=value overrides of --config, or the preset's ModelConfig fields",
    )
    parser.add_argument("--compile", action="store_true", help="compile the train step too")
    parser.add_argument("--batch", type=int, default=None, help="B, rows of the batch")
    parser.add_argument("--seq-len", type=int, default=None, help="T, tokens per row")
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="gradient accumulation k (train.microbatches)",
    )
    parser.add_argument(
        "--topology", help="compile with XLA:TPU for this slice, e.g. v5p:4x4x4 (needs libtpu)"
    )
    parser.add_argument(
        "--serve", action="store_true", help="the rollout server's programs (server.*) instead"
    )
    parser.add_argument("--hbm-gib", type=float, default=None, help="override the chip's HBM")
    parser.add_argument(
        "--lengths",
        help="trajectory lengths: a file of lengths or a named distribution such as lognormal "
        "(or lognormal:median=300,sigma=1,cut=0.05); report padded against packed batches",
    )
    parser.add_argument("--seed", type=int, default=0, help="the --lengths draw's seed")
    parser.add_argument(
        "--dump-hlo", help="write the compiled train step's (--serve: decode step's) HLO text here"
    )
    return parser.parse_intermixed_args(argv)


@dataclasses.dataclass(frozen=True)
class _Setup:
    name: str
    model: ModelConfig
    mesh: sharding.MeshConfig
    train: TrainConfig
    experiment: ExperimentConfig | None


def _configs(args: argparse.Namespace) -> _Setup:
    """The model, mesh and train config from --preset, --mesh and overrides, or --config and
    overrides."""
    if args.config is None:
        if args.mesh is None:
            raise ValueError("--preset needs --mesh")
        if args.serve:
            raise ValueError("--serve needs --config (its server.* settings)")
        model_cfg = _model_config(args.preset, args.overrides)
        return _Setup(
            args.preset, model_cfg, sharding.MeshConfig.parse(args.mesh), TrainConfig(), None
        )
    cfg = load_config(args.config, args.overrides)
    default = cfg.server.mesh if args.serve else cfg.train.mesh
    mesh_cfg = sharding.MeshConfig.parse(args.mesh) if args.mesh else default
    if args.serve:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, mesh=mesh_cfg))
    return _Setup(
        cfg.name, cfg.serving_model if args.serve else cfg.model, mesh_cfg, cfg.train, cfg
    )


def _batch_shape(args: argparse.Namespace, setup: _Setup) -> tuple[int | None, int | None, int]:
    """(B, T, k): the flags, else the config's batch (batch_groups · group_size rows of
    prefill + max_new_tokens) and train.microbatches."""
    cfg = setup.experiment
    batch, seq_len = args.batch, args.seq_len
    if cfg is not None:
        batch = batch or cfg.rollout.batch_groups * cfg.rollout.group_size
        seq_len = seq_len or cfg.server.max_prefill_length + cfg.completion_tokens
    return batch, seq_len, args.microbatches or setup.train.microbatches


def _train_step_config(setup: _Setup, microbatches: int) -> StepConfig:
    """The step ``--compile`` compiles, with or without ``--topology``: ``step_config`` of the
    experiment (of the defaults around the preset's model with ``--preset``), with
    ``microbatches`` (``--microbatches``, else ``train.microbatches``)."""
    cfg = setup.experiment or ExperimentConfig(name=setup.name, model=setup.model)
    return dataclasses.replace(step_config(cfg), microbatches=microbatches)


def _for_topology(args: argparse.Namespace, setup: _Setup) -> int:
    """``--topology``: compile with XLA:TPU for the slice and report; 0 fits, 1 does not."""
    if jax.config.jax_platforms is None:
        # Host computations stay on the CPU: on a TPU VM the plan must not take the chips.
        jax.config.update("jax_platforms", "cpu")
    _offline_libtpu(args.topology)
    devices = topology.topology_devices(args.topology)
    chip = topology.chip_of(devices, args.hbm_gib)
    mesh = sharding.make_mesh(setup.mesh, devices)
    print(memory.header(args.topology, devices, chip))
    if args.serve:
        lines, fits = memory.report_serve(setup.experiment, mesh, chip, dump_hlo=args.dump_hlo)
    elif args.lengths:
        optimizer = setup.train.optimizer.make(setup.train.steps)
        plan = memory.plan_memory(setup.model, setup.mesh, len(devices), optimizer)
        print(memory.format_plan(setup.name, plan))
        compile_shape = lengths.host_compile(
            setup.model, optimizer, _train_step_config(setup, _batch_shape(args, setup)[2]),
            mesh, on_tpu=True,
        )  # fmt: skip
        lines = _lengths_report(args, setup, plan, len(devices), compile_shape)
        fits = True
    else:
        batch, seq_len, k = _batch_shape(args, setup)
        if batch is None or seq_len is None:
            raise ValueError("--compile needs --batch and --seq-len (or a --config)")
        optimizer = setup.train.optimizer.make(setup.train.steps)
        plan = memory.plan_memory(setup.model, setup.mesh, len(devices), optimizer)
        print(memory.format_plan(setup.name, plan))
        lines, fits = memory.report_train(
            setup.model,
            optimizer,
            _train_step_config(setup, k),
            mesh,
            chip,
            plan,
            batch,
            seq_len,
            dump_hlo=args.dump_hlo,
        )
    print("\n".join(lines))
    return 0 if fits else 1


def _lengths_report(
    args: argparse.Namespace,
    setup: _Setup,
    plan: memory.MemoryPlan,
    num_devices: int,
    compile_shape: lengths.Compile | None = None,
) -> list[str]:
    """``--lengths``: padded against packed batches of the distribution (``lengths``); each
    compiled with ``compile_shape``, or, with ``--compile`` and no topology, on this host."""
    batch, seq_len, k = _batch_shape(args, setup)
    if batch is None or seq_len is None:
        raise ValueError("--lengths needs --batch and --seq-len (or a --config)")
    sizes = setup.mesh.axis_sizes(num_devices)
    shards = math.prod(sizes[a] for a in sharding.batch_axes(sizes))
    drawn = lengths.draw(args.lengths, batch, seq_len, seed=args.seed)
    shapes = lengths.batch_shapes(
        drawn,
        capacity=seq_len,
        length_bucket=setup.train.length_bucket,
        row_tokens=setup.train.row_tokens,
        microbatches=k,
        row_multiple=shards,
        microbatch_tokens=setup.train.microbatch_tokens,
    )
    label = "per-device total"
    if compile_shape is None and args.compile:
        optimizer = setup.train.optimizer.make(setup.train.steps)
        mesh = sharding.make_mesh(setup.mesh, jax.devices()[:num_devices])
        step_cfg = _train_step_config(setup, k)
        compile_shape = lengths.host_compile(setup.model, optimizer, step_cfg, mesh)
        label = "compiled temp"
    table = lengths.report(
        shapes,
        model_cfg=setup.model,
        active_params=plan.active_params,
        compile_shape=compile_shape,
        memory_label=label,
    )
    return [lengths.describe(args.lengths, drawn), *table]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1: the program does not fit)."""
    args = _parse(argv)
    try:
        setup = _configs(args)
        if args.topology:
            if not (args.compile or args.serve):
                raise ValueError("--topology needs --compile or --serve")
            return _for_topology(args, setup)
        if args.serve:
            raise ValueError("--serve needs --topology (the chip to compile for)")
        optimizer = setup.train.optimizer.make(setup.train.steps)
        plan = memory.plan_memory(setup.model, setup.mesh, args.devices, optimizer)
        batch, seq_len, k = _batch_shape(args, setup)
        if args.compile and (batch is None or seq_len is None):
            raise ValueError("--compile needs --batch and --seq-len")
    except (ValueError, TypeError, topology.LibtpuMissing, topology.LibtpuUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(memory.format_plan(setup.name, plan))
    if args.lengths:
        try:
            print("\n".join(_lengths_report(args, setup, plan, plan.num_devices)))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.compile:
        try:
            step_cfg = _train_step_config(setup, k)
            temp = memory.compiled_temp_bytes(
                setup.model, setup.mesh, step_cfg, batch, seq_len, optimizer=optimizer
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"batch            [{batch}, {seq_len}], {k} microbatch(es)")
        print(f"compiled temp bytes per device: {temp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
