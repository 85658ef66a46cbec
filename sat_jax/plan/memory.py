"""Memory plan of a preset or an experiment config on a mesh, from shapes alone (no allocation).

    python -m sat_jax.plan --preset qwen3_30b_a3b --mesh fsdp=64
    python -m sat_jax.plan --config configs/qwen3_30b_a3b_gsm8k.yaml   # its model and train.mesh
    python -m sat_jax.plan --preset small --mesh fsdp=8 --batch 8 --seq-len 2048 --compile \
        remat=layer   # with XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU

prints total and active parameter counts and the per-device bytes of parameters, gradients and the
optimizer state. Shapes come from ``nnx.eval_shape`` (the optimizer state's shapes and dtypes from
``jax.eval_shape`` of the trainer's real ``optimizer.init``: Adam's m and v are float32 whatever the
parameter dtype, ``sat_jax.optimizer``) and shardings from the rules in
``sat_jax.sharding`` applied to the mesh's axis sizes, so the numbers are exactly what
``init_train_state`` would place on each device (per-device bytes of a parameter = its bytes divided
by the product of the mesh axes its ``PartitionSpec`` shards it over). With ``--compile`` it also
lowers and compiles the configured train step (``sat_jax.step.step_config`` of the config, or of
the defaults with ``--preset``; the trainer's optimizer), the same one ``--topology`` compiles, for
a [batch, seq-len] batch on the mesh's devices and prints XLA's memory analysis of it:
``compiled temp bytes per device: N`` (activations and other temporaries).

For a TPU slice, with libtpu installed (no TPU needed; docs/DESIGN.md §9.1, docs/POD.md):

    python -m sat_jax.plan --config CFG [k=v ...] --topology v5p:4x4x4 --compile [--batch B --seq-len T]
    python -m sat_jax.plan --config CFG [k=v ...] --topology v5p:2x2x1 --serve

``--compile`` compiles with XLA:TPU the train step exactly as the trainer builds it (the config's
mesh, remat, attention, dispatch, dtypes, optimizer, and its ``StepConfig``; batch and
length default to the config's: ``rollout.batch_groups · rollout.group_size`` rows of
``server.max_prefill_length + rollout.max_new_tokens`` tokens) and prints its memory per device,
``per-device total: X GiB of Y GiB HBM: fits`` (or ``: does not fit``, exit status 1) and
``compiled/analytic FLOPs: R`` (``report_train``). ``--serve`` does the same for the rollout
server's prefill, insert and decode step on ``server.mesh`` (``report_serve``). ``--hbm-gib``
overrides the chip's HBM.

Active parameters: every parameter except the routed experts' weights (those stacked over a first
"exp" axis) and LoRA adapters, plus K/E of the experts' weights. With LoRA (``model.lora.rank`` > 0)
gradients and optimizer state cover the adapters only and the frozen base is counted once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from sat_jax import sharding
from sat_jax.config import TrainConfig
from sat_jax.decoding import SamplingConfig
from sat_jax.experiment import ExperimentConfig
from sat_jax.model import ModelConfig, placement
from sat_jax.model.layers import is_lora_path
from sat_jax.model.lora import split_lora
from sat_jax.optimizer import OptimizerConfig
from sat_jax.plan import programs, quantized, topology
from sat_jax.plan.topology import GIB
from sat_jax.step import StepConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Parameter counts and per-device bytes of one model config on one mesh.

    Attributes:
      mesh: resolved axis sizes.
      total_params: all parameters (LoRA adapters included).
      active_params: parameters one token uses (non-expert + K/E of the expert weights; LoRA
        adapters are not counted: a token multiplies by the adapted weight, W's size).
      trained_params: the parameters the optimizer updates: all of them, or with LoRA
        (``ModelConfig.lora.rank`` > 0) the adapters only.
      param_bytes: per-device bytes of the parameters (in ``param_dtype``; the frozen base and
        the adapters under LoRA).
      expert_param_bytes: the routed experts' share of ``param_bytes`` (their adapters included).
      grad_bytes: per-device bytes of the gradients (same dtype and sharding as the trained
        params: with LoRA, the adapters' only).
      adam_bytes: per-device bytes of the optimizer state (Adam's m and v, sharded like the
        trained params, and its replicated counters), in the dtypes its ``init`` gives.
    """

    mesh: dict[str, int]
    total_params: int
    active_params: int
    trained_params: int
    param_bytes: int
    expert_param_bytes: int
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

    With LoRA the base is counted once (``param_bytes``), and gradients and optimizer state
    cover the adapters only, as ``sat_jax.step.create_train_state`` holds them.

    Args:
      model_cfg: the model config.
      mesh_cfg: mesh axis sizes; a ``-1`` axis needs ``num_devices``.
      num_devices: total devices; default the product of the (explicit) axis sizes.
      optimizer: whose state to count; default the trainer's (``OptimizerConfig().make(TrainConfig().steps)``).

    Returns:
      A ``MemoryPlan``.
    """
    sizes = {name: getattr(mesh_cfg, name) for name in sharding.MESH_AXES}
    if num_devices is None:
        if -1 in sizes.values():
            raise ValueError("a mesh with a -1 axis needs num_devices (--devices)")
        num_devices = math.prod(sizes.values())
    mesh = sharding.abstract_mesh(mesh_cfg, num_devices)
    _, abstract = placement.abstract_model(model_cfg)
    specs = dict(nnx.to_flat_state(nnx.State(sharding.param_specs(abstract, mesh))))
    lora = model_cfg.lora.rank > 0
    total = expert = adapter = 0
    param_bytes = expert_bytes = trained_bytes = 0
    for path, var in nnx.to_flat_state(abstract):
        value = var.get_value()
        numel = math.prod(value.shape)
        shards = _num_shards(specs[path], dict(mesh.shape))
        total += numel
        logical = var.get_metadata().get("out_sharding") or ()
        nbytes = numel * np.dtype(value.dtype).itemsize // shards
        is_adapter, is_expert = is_lora_path(path), tuple(logical[:1]) == ("exp",)
        if is_adapter:
            adapter += numel
        elif is_expert:
            expert += numel
        if is_expert:
            expert_bytes += nbytes
        if is_adapter or not lora:
            trained_bytes += nbytes
        param_bytes += nbytes
    k, e = model_cfg.num_experts_per_tok, max(model_cfg.num_experts, 1)
    return MemoryPlan(
        mesh=dict(mesh.shape),
        total_params=total,
        active_params=total - adapter - expert + expert * k // e,
        trained_params=adapter if lora else total,
        param_bytes=param_bytes,
        expert_param_bytes=expert_bytes,
        grad_bytes=trained_bytes,
        adam_bytes=_optimizer_bytes(
            optimizer or OptimizerConfig().make(TrainConfig().steps), abstract, mesh, lora=lora
        ),
    )


def _optimizer_bytes(
    optimizer: optax.GradientTransformation,
    abstract: nnx.State,
    mesh: jax.sharding.AbstractMesh,
    *,
    lora: bool,
) -> int:
    """Per-device bytes of ``optimizer.init``'s state (``jax.eval_shape``) over the trained
    params (with LoRA, the adapters): param-like leaves sharded like their params, the rest
    replicated (as ``sat_jax.step.train_state_shardings``)."""
    is_spec = lambda x: isinstance(x, PartitionSpec)
    params = nnx.to_pure_dict(abstract)
    specs = sharding.param_specs(abstract, mesh)
    if lora:
        params, specs = split_lora(params)[1], split_lora(specs)[1]
    state = jax.eval_shape(optimizer.init, params)
    specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        state,
        specs,
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
        *(
            [f"trained params   {plan.trained_params:,} (LoRA adapters)"]
            if plan.trained_params != plan.total_params
            else []
        ),
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
    step_cfg: StepConfig,
    batch: int,
    seq_len: int,
    *,
    optimizer: optax.GradientTransformation | None = None,
) -> int:
    """Per-device temporary bytes of the compiled train step, from XLA's memory analysis.

    Compiles ``programs.compile_train_step`` (``optimizer``, default the trainer's; the step of
    ``step_cfg``) for a [batch, seq_len] batch on a mesh of this host's first devices (all of
    them for a -1 axis), from shapes only (nothing is allocated besides what compilation needs).
    """
    sizes = [getattr(mesh_cfg, name) for name in sharding.MESH_AXES]
    count = jax.device_count() if -1 in sizes else math.prod(sizes)
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:count])
    optimizer = optimizer or OptimizerConfig().make(TrainConfig().steps)
    compiled, _ = programs.compile_train_step(model_cfg, optimizer, step_cfg, mesh, batch, seq_len)
    return compiled.memory_analysis().temp_size_in_bytes


def verdict(total: int, hbm_bytes: int) -> str:
    """The contract line: ``per-device total: X GiB of Y GiB HBM: fits`` (or ``: does not fit``
    when ``total`` exceeds ``hbm_bytes``)."""
    fits = "fits" if total <= hbm_bytes else "does not fit"
    return f"per-device total: {total / GIB:.3f} GiB of {hbm_bytes / GIB:.3f} GiB HBM: {fits}"


def _out_of_memory(error: Exception, chip: topology.Chip, program: str = "") -> list[str]:
    """The report of a program XLA:TPU refused for lack of HBM."""
    message = str(error)
    first = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    parsed = topology.parse_out_of_memory(message)
    lines = [f"XLA:TPU refused the program{' ' + program if program else ''}: {first}"]
    if parsed is None:
        return [
            *lines,
            f"per-device total: >{chip.hbm_gib:.3f} GiB of {chip.hbm_gib:.3f} GiB HBM: does not fit",
        ]
    need, have = parsed
    lines.append(f"XLA:TPU's own HBM limit for this chip: {have / GIB:.3f} GiB")
    line = verdict(need, chip.hbm_bytes)
    return [*lines, line.replace(": fits", ": does not fit")]


def _memory_rows(memory: topology.ProgramMemory) -> list[str]:
    return [
        f"  arguments      {_gib(memory.argument)}",
        f"  outputs        {_gib(memory.output)} ({_gib(memory.alias)} of them in donated buffers)",
        f"  temporaries    {_gib(memory.temp)}",
        f"  code           {_gib(memory.code)}",
    ]


def header(name: str, devices: Sequence[jax.Device], chip: topology.Chip) -> str:
    return (
        f"topology         {name}: {len(devices)} x {devices[0].device_kind} ({chip.name}), "
        f"{chip.hbm_gib:g} GiB HBM and {chip.hbm_gbps:g} GB/s per chip "
        "(Cloud TPU docs; --hbm-gib overrides)"
    )


def report_train(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    step_cfg: StepConfig,
    mesh: jax.sharding.Mesh,
    chip: topology.Chip,
    plan: MemoryPlan,
    batch: int,
    seq_len: int,
    dump_hlo: str | None = None,
) -> tuple[list[str], bool]:
    """(the report lines, whether it fits) of the train step compiled with XLA:TPU on ``mesh``.

    The per-device total is argument + output − alias + temp + code
    (``topology.ProgramMemory.total``): the state, batch and new state (the donated state's
    buffers hold the new one, so it counts once), the step's scratch and its code.

    compiled/analytic FLOPs: the matmul FLOPs of one device's partitioned program, loops times
    their trip counts (``hlo_flops``; XLA's ``cost_analysis`` counts a loop body once and is
    printed beside it), times the devices, over ``programs.train_flops``. Above 1 by design
    with remat (``programs.expected_recompute``); beyond that it is work the analytic count
    does not plan for, such as an expert computation over all experts.
    """
    c = model_cfg
    lines = [
        f"train step       batch [{batch}, {seq_len}], {step_cfg.microbatches} microbatch(es), "
        f"remat={c.remat}, attention={c.attention}, dispatch={c.dispatch}, "
        f"dtype={jnp.dtype(c.dtype).name}, params {jnp.dtype(c.param_dtype).name}, "
        f"routing replay {'on' if step_cfg.routing_replay else 'off'}"
    ]
    try:
        with topology.traced_for("tpu", mesh.devices.size):
            compiled, seconds = programs.compile_train_step(
                c, optimizer, step_cfg, mesh, batch, seq_len
            )
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return [*lines, *_out_of_memory(e, chip)], False
    if dump_hlo:
        with open(dump_hlo, "w") as f:
            f.write(compiled.as_text())
    memory = topology.ProgramMemory.of(compiled)
    devices = mesh.devices.size
    counted = programs.matmul_flops(compiled)
    flops = counted.flops * devices
    analytic = programs.train_flops(c, plan.active_params, batch, seq_len)
    factor, reasons = programs.expected_recompute(c, step_cfg)
    lines += [
        f"compile time     {seconds:.1f} s",
        "per device (XLA:TPU memory analysis):",
        *_memory_rows(memory),
        verdict(memory.total, chip.hbm_bytes),
        f"compiled FLOPs   {flops:.4g} = {devices} devices x {counted.flops:.4g} (matmuls, "
        f"loops x trip counts; XLA cost_analysis: {programs.xla_cost_flops(compiled):.4g})",
        f"analytic FLOPs   {analytic:.4g} = 6 x {programs.matmul_params(c, plan.active_params):,} "
        f"matmul params x {batch * seq_len:,} tokens + causal attention",
        f"compiled/analytic FLOPs: {flops / analytic:.3f}",
        f"by design        {factor:.3f}" + (f" ({'; '.join(reasons)})" if reasons else ""),
    ]
    if counted.unknown_loops:
        lines.append(f"loops counted once (bound not a constant): {len(counted.unknown_loops)}")
    return lines, memory.total <= chip.hbm_bytes


def _serve_table(
    cfg: ExperimentConfig,
    progs: programs.ServerPrograms,
    mem: dict[str, topology.ProgramMemory],
    cache: int,
    cache_shards: int,
    param_bytes: int,
) -> list[str]:
    """The server report's lines before its verdict: shapes, compile time, each program's memory,
    the KV cache and the params."""
    model_cfg, s, r = cfg.serving_model, cfg.server, cfg.rollout
    lines = [
        f"server           {s.slots} slots, prefill {s.max_prefill_length}, max_new_tokens "
        f"{r.max_new_tokens} ({progs.cache_length} cache positions, {progs.cache_positions} "
        "stored), params "
        f"{model_cfg.params_dtype.name}, dtype {jnp.dtype(model_cfg.dtype).name}",
        f"compile time     {progs.seconds:.1f} s (prefill, insert, generate)",
        "per device (XLA:TPU memory analysis):   argument     output      alias       temp",
    ]
    for name, m in mem.items():
        label = f"generate[{progs.window}]" if name == "generate" else name
        lines.append(
            f"  {label:<15}"
            + "".join(f"{x / GIB:>11.3f}" for x in (m.argument, m.output, m.alias, m.temp))
        )
    return [
        *lines,
        f"KV cache         {_gib(cache // cache_shards)} per device ({_gib(cache)} in all, "
        f"over {cache_shards} shard(s))",
        f"params           {_gib(param_bytes)} per device, once more during a weight swap",
    ]


def report_serve(
    cfg: ExperimentConfig,
    mesh: jax.sharding.Mesh,
    chip: topology.Chip,
    dump_hlo: str | None = None,
) -> tuple[list[str], bool]:
    """(the report lines, whether it fits) of the rollout server's programs on ``mesh``.

    The per-device total is what the server holds at its peak: the served params and the decode
    state (generate's arguments), a second copy of the params (a weight update is loaded before
    the old params are dropped, ``MoEEngine.swap_params``), two prefixes (``prefill_once``
    keeps the last one and hands out a copy), the largest program's temporaries and every
    program's code. ``dump_hlo``: a path to write the compiled decode step's HLO text to.
    The programs are compiled for ``server.weight_dtype`` and ``server.kv_cache_dtype``; the
    report ends with every other combination of the two (`quantized.dtype_table`).
    """
    model_cfg, s, r = cfg.serving_model, cfg.server, cfg.rollout
    try:
        with topology.traced_for("tpu", mesh.devices.size):
            progs = programs.compile_server_programs(
                model_cfg,
                mesh,
                slots=s.slots,
                max_prefill_length=s.max_prefill_length,
                max_decode_length=cfg.completion_tokens,
                sampling=SamplingConfig.from_rollout(r),
                weight_dtype=s.weight_dtype,
                kv_cache_dtype=s.kv_cache_dtype,
            )
    except programs.ProgramOutOfMemory as e:
        return _out_of_memory(e.__cause__, chip, e.program), False
    if dump_hlo:
        with open(dump_hlo, "w") as f:
            f.write(progs.generate.as_text())
    mem = {
        name: topology.ProgramMemory.of(getattr(progs, name))
        for name in ("prefill", "insert", "generate")
    }
    plan = plan_memory(model_cfg, cfg.server.mesh, mesh.devices.size)
    sizes = dict(mesh.shape)
    cache_spec = sharding.logical_to_spec(
        ("layers", None, "length", "kv_heads", "head_dim"),
        shape=(model_cfg.num_layers, s.slots, progs.cache_positions, model_cfg.num_kv_heads, 1),
        mesh=sizes,
    )
    cache_shards = _num_shards(cache_spec, sizes)
    cache = programs.kv_cache_bytes(model_cfg, s.slots, progs.cache_positions, s.kv_cache_dtype)
    pushed = quantized.pushes_quantized(cfg.model.lora.rank)
    served = quantized.served_bytes(
        model_cfg,
        mesh,
        s.weight_dtype,
        s.kv_cache_dtype,
        slots=s.slots,
        positions=progs.cache_positions,
        cache_shards=cache_shards,
        pushed_quantized=pushed,
    )
    plan = dataclasses.replace(plan, param_bytes=served.params, expert_param_bytes=served.experts)
    total = (
        mem["generate"].argument
        + served.swap_peak
        - served.params
        + 2 * mem["prefill"].output
        + max(m.temp for m in mem.values())
        + sum(m.code for m in mem.values())
    )
    lines = _serve_table(cfg, progs, mem, cache, cache_shards, plan.param_bytes)
    if served.params != served.full and not pushed:  # 8-bit weights quantized on the way in
        lines[-1] += f" (and the pushed {_gib(served.full)} while it is quantized)"
    lines.append(verdict(total, chip.hbm_bytes))
    lines += _roofline(
        model_cfg,
        plan,
        progs,
        mem["generate"],
        cache // cache_shards,
        chip,
        s.slots,
        mesh.devices.size,
    )
    lines += quantized.dtype_table(
        model_cfg,
        mesh,
        (s.weight_dtype, s.kv_cache_dtype),
        total,
        slots=s.slots,
        positions=progs.cache_positions,
        cache_shards=cache_shards,
        touched=programs.touched_expert_fraction(model_cfg, s.slots),
        hbm_bytes=chip.hbm_bytes,
        hbm_gbps=chip.hbm_gbps,
        pushed_quantized=pushed,
    )
    return lines, total <= chip.hbm_bytes


def _roofline(
    model_cfg, plan, progs, generate, cache_per_device, chip, slots, devices
) -> list[str]:
    """Per generated token: FLOPs and the HBM bytes a decode step must read, and the
    memory-bound tokens/s of one server (its mesh) at the chip's bandwidth."""
    touched = programs.touched_expert_fraction(model_cfg, slots)
    weights = plan.param_bytes - plan.expert_param_bytes * (1.0 - touched)
    step_bytes = weights + cache_per_device
    analytic = programs.decode_flops_per_token(model_cfg, plan.active_params, progs.window)
    compiled = programs.matmul_flops(progs.generate).flops * devices / slots
    step_s = step_bytes / (chip.hbm_gbps * 1e9)
    compute_s = compiled * slots / devices / (chip.bf16_tflops * 1e12)
    return [
        f"per token        decode FLOPs {analytic:.4g} analytic, {compiled:.4g} compiled "
        f"(window {progs.window})",
        f"per step/device  reads {_gib(int(step_bytes))}: weights {_gib(int(weights))} "
        f"({touched:.0%} of experts touched by {slots} slots), cache {_gib(cache_per_device)} "
        f"= {step_bytes / slots / 2**20:.2f} MiB per token",
        f"roofline         {slots / step_s:,.0f} tokens/s per server at {chip.hbm_gbps:g} GB/s "
        f"({step_s * 1e3:.2f} ms per step memory-bound; compute floor {compute_s * 1e3:.2f} ms)",
    ]
