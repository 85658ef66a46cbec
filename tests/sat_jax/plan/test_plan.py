"""Memory plan: counts and per-device bytes from shapes and the sharding rules, no devices."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from sat_jax import sharding
from sat_jax.experiment import ExperimentConfig, load_config
from sat_jax.model import LoRAConfig, ModelConfig, placement
from sat_jax.plan import __main__ as plan_command
from sat_jax.plan import memory as plan
from sat_jax.plan import programs, topology
from sat_jax.plan.__main__ import main as plan_main
from sat_jax.step import StepConfig, step_config

REPO = pathlib.Path(__file__).resolve().parents[3]


@functools.cache
def _plan(preset: str, mesh: str) -> plan.MemoryPlan:
    return plan.plan_memory(ModelConfig.preset(preset), sharding.MeshConfig.parse(mesh))


def _by_hand(cfg: ModelConfig) -> tuple[int, int]:
    """Total and active parameter counts from the architecture, written from the HF layout."""
    d, h = cfg.d_model, cfg.head_dim
    attn = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * h + 2 * d
    expert = 3 * d * cfg.expert_dim
    total = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + d
    active = total
    for i in range(cfg.num_layers):
        total += attn
        active += attn
        if cfg.is_moe_layer(i):
            total += d * cfg.num_experts + cfg.num_experts * expert
            active += d * cfg.num_experts + cfg.num_experts_per_tok * expert
        else:
            total += 3 * d * cfg.dense_dim
            active += 3 * d * cfg.dense_dim
    return total, active


@pytest.mark.parametrize("preset", ["tiny", "qwen3_30b_a3b"])
def test_counts_match_the_architecture(preset: str) -> None:
    cfg = ModelConfig.preset(preset)
    got = _plan(preset, "fsdp=64")
    assert (got.total_params, got.active_params) == _by_hand(cfg)
    if preset == "qwen3_30b_a3b":  # the model card: 30.5B total, 3.3B activated
        assert round(got.total_params / 1e9, 1) == 30.5
        assert 3.3e9 <= got.active_params < 3.4e9


def test_per_device_bytes_follow_the_specs() -> None:
    cfg = ModelConfig.preset("tiny", param_dtype="bfloat16")
    mesh_cfg = sharding.MeshConfig(data=2, fsdp=4, tensor=2)
    got = plan.plan_memory(cfg, mesh_cfg)
    assert got.num_devices == 16 and got.mesh["fsdp"] == 4
    # Independently: each param's bytes over the product of the axis sizes it is sharded on.
    _, abstract = placement.abstract_model(cfg)
    sizes = {"data": 2, "fsdp": 4, "expert": 1, "tensor": 2}
    specs = sharding.param_specs(abstract, sizes)
    import jax

    shapes = jax.tree.leaves(abstract)
    spec_leaves = jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    numel_per_dev = 0
    for shape_dtype, spec in zip(shapes, spec_leaves, strict=True):
        axes = [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]
        numel_per_dev += math.prod(shape_dtype.shape) // math.prod(sizes[a] for a in axes)
    assert got.param_bytes == 2 * numel_per_dev == got.grad_bytes
    # Adam's m and v in float32, plus its and the schedule's int32 step counters (replicated).
    assert got.adam_bytes == 8 * numel_per_dev + 2 * 4
    assert got.total_bytes == 12 * numel_per_dev + 2 * 4
    # Fully replicated on one device: every byte of every param.
    one = plan.plan_memory(cfg, sharding.MeshConfig(fsdp=1))
    assert one.param_bytes == 2 * one.total_params
    assert got.param_bytes < one.param_bytes


def test_minus_one_axis_needs_a_device_count() -> None:
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="num_devices"):
        plan.plan_memory(cfg, sharding.MeshConfig(fsdp=-1))
    assert plan.plan_memory(cfg, sharding.MeshConfig(fsdp=-1), 32).mesh["fsdp"] == 32


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "sat_jax.plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow  # the plan command in a process
def test_cli_qwen3_30b_on_fsdp_64() -> None:
    res = _cli("--preset", "qwen3_30b_a3b", "--mesh", "fsdp=64")
    assert res.returncode == 0, res.stderr
    want = _plan("qwen3_30b_a3b", "fsdp=64")
    assert res.stdout.strip() == plan.format_plan("qwen3_30b_a3b", want)
    assert (
        "30,532,122,624" in res.stdout and "fsdp=64, expert=1, tensor=1 (64 devices)" in res.stdout
    )
    assert np.isclose(want.param_bytes / 2**30, 1.824, atol=1e-3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--preset", "nope", "--mesh", "fsdp=8"), "unknown preset 'nope'"),
        (("--preset", "tiny", "--mesh", "fsdp=x"), "size 'x' is not an integer"),
        (("--preset", "tiny", "--mesh", "pipe=2"), "bad mesh entry 'pipe=2'"),
        (("--preset", "tiny", "--mesh", "fsdp=0"), "MeshConfig.fsdp must be >= 1"),
    ],
)
def test_bad_arguments_are_clear_errors(args: tuple[str, ...], message: str) -> None:
    assert plan_main(list(args)) == 2
    if args[1] == "nope":  # one subprocess run is enough to cover the CLI error path
        res = _cli(*args)
        assert res.returncode == 2 and message in res.stderr


@pytest.mark.slow  # the plan command in a process, on the 30B config
def test_cli_config_of_the_pod_setup() -> None:
    """The paper's pod config: its model and train.mesh (fsdp=64), from the YAML."""
    config = str(REPO / "configs" / "qwen3_30b_a3b_gsm8k.yaml")
    assert plan_main(["--config", config]) == 0
    want = plan.plan_memory(ModelConfig.preset("qwen3_30b_a3b"), sharding.MeshConfig(fsdp=64))
    assert want.num_devices == 64 and want.total_params == 30_532_122_624
    res = _cli("--config", config)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == plan.format_plan("qwen3_30b_a3b_gsm8k", want)
    assert plan_main(["--config", config, "model.bogus=1"]) == 2
    assert plan_main(["--preset", "tiny"]) == 2  # a preset needs --mesh


def test_optimizer_state_dtypes_come_from_its_init():
    # bfloat16 master weights: params and gradients halve, the float32 moments do not.
    cfg = ModelConfig.preset("tiny")
    f32 = plan.plan_memory(cfg, sharding.MeshConfig(fsdp=1))
    bf16 = plan.plan_memory(cfg.replace(param_dtype="bfloat16"), sharding.MeshConfig(fsdp=1))
    assert bf16.param_bytes * 2 == f32.param_bytes
    assert bf16.adam_bytes == f32.adam_bytes == 8 * f32.total_params + 2 * 4


@pytest.mark.slow  # compiles the sharded step three times
def test_compile_prints_xla_temp_bytes_of_the_sharded_step(capsys) -> None:
    args = ["--preset", "tiny", "--mesh", "fsdp=8", "--batch", "8", "--seq-len", "64"]
    assert plan_main([*args, "--compile", "remat=layer"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:-2] == plan.format_plan("tiny", _plan("tiny", "fsdp=8")).splitlines()
    label, _, value = lines[-1].partition(": ")
    assert label == "compiled temp bytes per device" and int(value) > 0
    # Sharding the 8 rows over 8 devices must shrink each device's share (the scanned layers'
    # carry keeps its batch sharding).
    model_cfg = ModelConfig.preset("tiny", remat="layer")
    # --preset compiles the default experiment's step around the preset's model.
    step_cfg = step_config(ExperimentConfig(name="tiny", model=model_cfg))
    one_row = plan.compiled_temp_bytes(
        model_cfg, sharding.MeshConfig.parse("fsdp=8"), step_cfg, 8, 64
    )
    eight_rows = plan.compiled_temp_bytes(model_cfg, sharding.MeshConfig(fsdp=1), step_cfg, 8, 64)
    assert one_row == int(value) and one_row < eight_rows / 2


def test_compile_needs_a_batch_shape() -> None:
    assert plan_main(["--preset", "tiny", "--mesh", "fsdp=1", "--compile"]) == 2


def test_the_compiled_step_takes_the_truncation_replay_and_the_recomputed_proximal():
    """What `--compile` builds for a config with top_p < 1 and train.old_logp=recompute: the
    batch carries kept counts [B, T] int32 (one more input than without), and it compiles."""
    import jax
    import optax

    from sat_jax import objectives
    from sat_jax.plan import programs

    cfg = ModelConfig.preset("tiny")
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    inputs = {}
    for kept in (False, True):
        step_cfg = StepConfig(
            loss=objectives.PolicyLossConfig(tis_cap=2.0),
            routing_replay=True,
            kept_counts=kept,
            recompute_old_logp=True,
        )
        compiled, _ = programs.compile_train_step(cfg, optax.adam(1e-3), step_cfg, mesh, 4, 32)
        assert programs.xla_cost_flops(compiled) > 0
        inputs[kept] = [(x.shape, x.dtype) for x in jax.tree.leaves(compiled.args_info)]
    assert len(inputs[True]) == len(inputs[False]) + 1
    token_shaped = ((4, 32), jax.numpy.dtype("int32"))  # the tokens, and the kept counts
    assert inputs[True].count(token_shaped) == inputs[False].count(token_shaped) + 1


class _Compiled(Exception):
    """Stops ``plan.main`` once it has asked for the train step."""


def _compiled_steps(monkeypatch, argv: list[str]) -> list[tuple]:
    """What ``plan.main(argv)`` asks ``programs.compile_train_step`` to compile: (model config,
    step config, mesh shape, batch, seq_len) per call. A topology's devices are this host's CPU
    devices, so the --topology path runs without a TPU up to the compile."""
    calls = []

    def compile_train_step(model_cfg, optimizer, step_cfg, mesh, batch, seq_len):
        calls.append((model_cfg, step_cfg, dict(mesh.shape), batch, seq_len))
        raise _Compiled

    monkeypatch.setattr(programs, "compile_train_step", compile_train_step)
    monkeypatch.setattr(topology, "topology_devices", lambda name: jax.devices()[:4])
    monkeypatch.setattr(topology, "chip_of", lambda devices, hbm_gib=None: topology.CHIPS["TPU v5"])
    # The entry point keeps libtpu off the network through the environment: not in this process.
    monkeypatch.setattr(plan_command, "_offline_libtpu", lambda name: None)
    with pytest.raises(_Compiled):
        plan_main(argv)
    return calls


OPTIONS = [  # every step option away from its default
    "train.loss.sat.enabled=false",
    "train.loss.tis_cap=2.0",
    "train.loss.kl_coef=0.1",
    "train.old_logp=recompute",
    "train.microbatches=2",
    "train.advantage_estimator=dr_grpo",
    "rollout.top_p=0.9",
    "rollout.temperature=0.7",
    "train.mesh.fsdp=4",
]


def test_compile_with_and_without_a_topology_builds_the_configured_step(monkeypatch) -> None:
    """``--compile`` on this host and ``--topology`` compile the same step: the experiment's
    ``step_config`` (routing replay, the KL reference, truncation replay, the recomputed proximal,
    microbatches, ...), on the same model, mesh and batch."""
    config = str(REPO / "configs" / "arith_tiny.yaml")
    want = step_config(load_config(config, OPTIONS))
    assert want.uses_reference and want.kept_counts and want.recompute_old_logp
    assert want.routing_replay and want.microbatches == 2 and want.estimator == "dr_grpo"
    host = _compiled_steps(monkeypatch, ["--config", config, *OPTIONS, "--compile"])
    tpu = _compiled_steps(
        monkeypatch, ["--config", config, *OPTIONS, "--topology", "v5p:2x2x1", "--compile"]
    )
    assert host == tpu and len(host) == 1
    assert host[0][1] == want
    # --microbatches overrides train.microbatches in both.
    flag = ["--config", config, *OPTIONS, "--compile", "--microbatches", "4"]
    assert _compiled_steps(monkeypatch, flag)[0][1] == dataclasses.replace(want, microbatches=4)


def _adapters_by_hand(cfg: ModelConfig) -> int:
    """LoRA parameters on attention and the experts: A [in, r] and B [r, out] per weight."""
    d, h, r, f = cfg.d_model, cfg.head_dim, cfg.lora.rank, cfg.expert_dim
    q, kv = cfg.num_heads * h, cfg.num_kv_heads * h
    attn = (d * r + r * q) + 2 * (d * r + r * kv) + (q * r + r * d)
    experts = cfg.num_experts * 3 * (d * r + r * f)
    return cfg.num_layers * attn + cfg.num_moe_layers * experts


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_lora_trains_only_the_adapters_and_counts_the_base_once(preset: str) -> None:
    base_cfg = ModelConfig.preset(preset, param_dtype="bfloat16")
    cfg = base_cfg.replace(lora=LoRAConfig(rank=8, targets=("attention", "experts")))
    one = sharding.MeshConfig(fsdp=1)
    base, got = plan.plan_memory(base_cfg, one), plan.plan_memory(cfg, one)
    adapters = _adapters_by_hand(cfg)
    assert got.trained_params == adapters and base.trained_params == base.total_params
    assert got.total_params == base.total_params + adapters
    assert got.active_params == base.active_params
    # The base once, in its param dtype, beside the adapters; gradients and Adam only theirs.
    assert got.param_bytes == 2 * (base.total_params + adapters)
    assert got.grad_bytes == 2 * adapters
    assert got.adam_bytes == 8 * adapters + 2 * 4
    assert got.total_bytes < base.total_bytes
    # Sharded: the adapters follow their weights' rules, the rank stays whole.
    mesh = sharding.MeshConfig(fsdp=2, expert=2, tensor=2)
    sharded = plan.plan_memory(cfg, mesh)
    assert sharded.grad_bytes < got.grad_bytes and sharded.param_bytes < got.param_bytes


def test_cli_sets_lora_fields(capsys) -> None:
    args = ["--preset", "tiny", "--mesh", "fsdp=1", "lora.rank=8"]
    assert plan_main([*args, "lora.targets=[attention]"]) == 0
    out = capsys.readouterr().out
    cfg = ModelConfig.preset("tiny", lora=LoRAConfig(rank=8, targets=("attention",)))
    want = plan.plan_memory(cfg, sharding.MeshConfig(fsdp=1))
    assert out.strip() == plan.format_plan("tiny", want)
    assert f"trained params   {want.trained_params:,} (LoRA adapters)" in out
    assert plan_main([*args, "lora.targets=[shared_expert]"]) == 2
