"""Padded against packed batches of a length distribution (``python -m sat_jax.plan --lengths``).

A batch's trajectories (``rollout.batch_groups · rollout.group_size``, prompt + completion
tokens) are drawn from a length distribution, then laid out as the trainer would:

- padded: one trajectory per row, T = the ``train.length_bucket`` rule of the longest;
- packed (``train.packing``): ``sat_jax.packing.layout`` (``budget_layout`` with
  ``train.microbatch_tokens``), rows of ``train.row_tokens`` (0 = the capacity), the rows a
  multiple of the data shards;

both in ``train.microbatches`` microbatches, or split by ``train.microbatch_tokens``
(``batch_shapes``).

For each it reports the padded fraction (padded token slots ÷ all, the ``pad_frac`` metric), the
step's FLOPs per useful token (trajectory token) and, when compiled, the per-device memory: with
``--compile`` each batch's train step is compiled (with ``--topology`` by XLA:TPU for the slice)
and its FLOPs are the compiled program's matmuls (``programs.matmul_flops``, every device);
without, the analytic ``programs.train_flops`` (causal attention over whole rows: a packed row's
kernel computes the scores across its segments and masks them).

Distributions (``--lengths``): a file of lengths (whitespace-separated integers; the batch takes
the first N, cycled when there are fewer), or a named one with optional ``key=value`` settings:

- ``lognormal[:median=300,sigma=1,cut=0.05]``: exp(N(log median, σ²)) rounded, clipped to
  [2, cap], and a fraction ``cut`` of the batch exactly at the cap (completions cut at
  ``rollout.max_new_tokens``): the long tail of reasoning models' answers, most a few hundred
  tokens, the cut ones at the cap. The cap is the capacity, ``server.max_prefill_length +
  rollout.max_new_tokens``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax

from sat_jax import packing
from sat_jax.model import ModelConfig
from sat_jax.plan import programs, topology
from sat_jax.step import StepConfig

GIB = 2**30
NAMED = {"lognormal": {"median": 300.0, "sigma": 1.0, "cut": 0.05}}


def draw(spec: str, n: int, cap: int, *, seed: int = 0) -> np.ndarray:
    """int64 [n] lengths of ``spec`` (a named distribution or a file, module docstring).

    Raises:
      ValueError: an unknown name or setting, an empty file, or a length over ``cap`` in a file.
    """
    name, _, settings = spec.partition(":")
    if name not in NAMED:
        if not os.path.isfile(spec):
            raise ValueError(f"--lengths {spec!r}: neither a file nor one of {sorted(NAMED)}")
        with open(spec) as f:
            values = np.array([int(v) for v in f.read().split()], np.int64)
        if not values.size:
            raise ValueError(f"--lengths {spec!r}: no lengths")
        if values.max() > cap or values.min() < 1:
            raise ValueError(f"--lengths {spec!r}: lengths must be in [1, {cap}] (the capacity)")
        return np.resize(values, n)
    params = dict(NAMED[name])
    for item in filter(None, settings.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in params:
            raise ValueError(f"--lengths {name}: settings are {sorted(params)}, got {item!r}")
        params[key] = float(value)
    rng = np.random.default_rng(seed)
    lengths = np.exp(np.log(params["median"]) + params["sigma"] * rng.standard_normal(n))
    lengths = np.clip(np.round(lengths), 2, cap).astype(np.int64)
    lengths[rng.permutation(n)[: round(params["cut"] * n)]] = cap
    return lengths


def describe(spec: str, lengths: np.ndarray) -> str:
    return (
        f"lengths          {spec}: {len(lengths)} trajectories of {lengths.min()} to "
        f"{lengths.max()} tokens (median {np.median(lengths):g}), {lengths.sum():,} in all"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchShape:
    """One batch layout of the trajectories.

    Attributes:
      name: "padded" or "packed".
      rows, length: the batch's [rows, T].
      microbatches: k.
      used: the trajectories' tokens.
      view: with packing, (N, C) of the trajectory view (``TrainBatch.view_index``).
    """

    name: str
    rows: int
    length: int
    microbatches: int
    used: int
    view: tuple[int, int] | None = None

    @property
    def pad_frac(self) -> float:
        return 1.0 - self.used / (self.rows * self.length)


def batch_shapes(
    lengths: np.ndarray,
    *,
    capacity: int,
    length_bucket: int,
    row_tokens: int,
    microbatches: int,
    row_multiple: int,
    microbatch_tokens: int = 0,
) -> tuple[BatchShape, BatchShape]:
    """The padded and the packed layout of trajectories of ``lengths`` (module docstring).

    With ``microbatch_tokens`` (``train.microbatch_tokens``) both are split by that token
    budget: the padded batch into ``rows · T / budget`` microbatches, the packed one as
    ``train.packing.pack_batch`` lays it out (``sat_jax.packing.budget_layout``: k and the rows
    per microbatch chosen together, the fewest rows within the budget); else both into
    ``microbatches``.
    """
    n, used = len(lengths), int(np.sum(lengths))
    longest = packing.row_length(int(lengths.max()), bucket=length_bucket, cap=capacity)
    k = microbatches
    if microbatch_tokens:
        k = max(1, n * longest // microbatch_tokens)
    padded = BatchShape(name="padded", rows=n, length=longest, microbatches=k, used=used)

    rule = dict(capacity=row_tokens or capacity, row_multiple=row_multiple)
    if microbatch_tokens:
        lay = packing.budget_layout(
            lengths,
            microbatch_tokens=microbatch_tokens,
            length_bucket=length_bucket,
            slots=n,
            **rule,
        )
        k = lay.microbatches
    else:
        k = microbatches
        lay = packing.layout(
            lengths, microbatches=k, length_bucket=length_bucket, most=n // k, **rule
        )
    view = n if lay.order is None else len(lay.order)
    packed = BatchShape(
        name="packed",
        rows=lay.rows,
        length=lay.length,
        microbatches=k,
        used=used,
        view=(view, longest),
    )
    return padded, packed


Compile = Callable[[BatchShape], tuple[float, int | None]]


def host_compile(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    step_cfg: StepConfig,
    mesh: jax.sharding.Mesh,
    *,
    on_tpu: bool = False,
) -> Compile:
    """A ``Compile``: the batch's train step (``step_cfg`` with the batch's k) compiled on
    ``mesh`` (on a TPU topology's devices with ``on_tpu``) → (compiled matmul FLOPs of every device, per-device bytes: the total
    with ``on_tpu`` (``ProgramMemory.total``), else XLA's temporaries)."""

    def compile_shape(shape: BatchShape) -> tuple[float, int | None]:
        devices = mesh.devices.size
        traced = topology.traced_for("tpu", devices) if on_tpu else contextlib.nullcontext()
        cfg = dataclasses.replace(step_cfg, microbatches=shape.microbatches)
        with traced:
            compiled, _ = programs.compile_train_step(
                model_cfg, optimizer, cfg, mesh, shape.rows, shape.length, packed=shape.view
            )
        memory = topology.ProgramMemory.of(compiled)
        flops = programs.matmul_flops(compiled).flops * devices
        return flops, memory.total if on_tpu else memory.temp

    return compile_shape


def report(
    shapes: Sequence[BatchShape],
    *,
    model_cfg: ModelConfig,
    active_params: int,
    compile_shape: Compile | None = None,
    memory_label: str = "per-device total",
) -> list[str]:
    """The table: per batch its [rows, T], k, padded fraction, FLOPs (compiled with
    ``compile_shape``, else analytic) per useful token and, compiled, its per-device bytes."""
    kind = "compiled" if compile_shape else "analytic"
    lines = [
        f"{'batch':<8} {'rows x T':>14} {'k':>3} {'pad_frac':>9} {kind + ' FLOPs':>15} "
        f"{'FLOPs/useful token':>19} {memory_label + ' GiB':>21}"
    ]
    for shape in shapes:
        memory = None
        if compile_shape is None:
            flops = programs.train_flops(model_cfg, active_params, shape.rows, shape.length)
        else:
            flops, memory = compile_shape(shape)
        gib = "-" if memory is None else f"{memory / GIB:.3f}"
        lines.append(
            f"{shape.name:<8} {f'{shape.rows} x {shape.length}':>14} {shape.microbatches:>3} "
            f"{shape.pad_frac:>9.4f} {flops:>15.4g} {flops / shape.used:>19.4g} {gib:>21}"
        )
    return lines
