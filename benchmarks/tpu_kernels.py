"""Compile the model's attention and MoE dispatch for a TPU topology on a CPU host: XLA:TPU's FLOPs
against the analytic FLOPs, and which Mosaic kernels the programs hold.

Run (libtpu importable, e.g. unpacked from its wheel into DIR; nothing runs on a TPU):
  TPU_SKIP_MDS_QUERY=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=$PWD:DIR \\
    python benchmarks/tpu_kernels.py [--topology v5p:2x2x1] [--mesh fsdp=4] [--tokens 4096]

Parts, each `jax.jit(...).lower(ShapeDtypeStructs with NamedShardings).compile()` under the mesh
(`jax.set_mesh`, as the train step traces), forward + backward (`value_and_grad`):
  * one MoE layer (`sat_jax.model.moe.MoE`) Qwen3-30B-A3B-sized (D 2048, F 768, E 128, K 8) with
    `--tokens` tokens per device, per dispatch path; analytic = 6 · active params · tokens, active
    params = 3·D·F·K (experts) + D·E (router);
  * causal GQA attention Qwen3-30B-A3B-sized (N 32, G 4, H 128), one `--seq-len` row per device,
    per attention path; analytic = 3 × 2·B·N·H·T² (forward: q·kᵀ and p·v over the causal half;
    the backward counted as twice the forward);
  * the `tiny` preset's full forward + backward under `attention=auto`, `dispatch=auto`, to show
    "auto" picks the kernels for a TPU target (head_dim 16 padded to 128) and that they lower.
FLOPs are XLA's `cost_analysis()` of the partitioned (per-device) program times the devices. A
Pallas kernel counts what its `CostEstimate` says: megablox gmm says 2·m·k·n over all m rows it
may visit (the shard's every token-slot, padded to the row tile), not the rows it visits; splash
attention gives none, so its FLOPs are missing from the count (reported as such).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import time

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from sat_jax import sharding
from sat_jax.model import ModelConfig, placement
from sat_jax.model.attention import causal_attention
from sat_jax.model.moe import MoE

D_MODEL, EXPERT_DIM, EXPERTS, TOP_K = 2048, 768, 128, 8
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def tpu_devices(topology: str) -> list:
    """The devices of a TPU topology "vXp:AxBxC" (one host's chips bounded at 2x2x1)."""
    dims = tuple(int(x) for x in topology.split(":")[1].split("x"))
    host = tuple(min(d, b) for d, b in zip(dims, (2, 2, 1), strict=False))
    topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name="default",
        chips_per_host_bounds=host,
        num_slices=1,
    )
    return list(topo.devices)


def compile_report(fn, args, mesh, analytic: float) -> dict:
    """Compiles ``fn(*args)`` (abstract, sharded) under ``mesh``; FLOPs, ratio, kernels, bytes."""
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    flops = compiled.cost_analysis()["flops"] * mesh.size
    text = compiled.as_text()
    kernels = collections.Counter(
        re.sub(r"[.\d]+$", "", name)
        for name in re.findall(
            r"^\s*(?:ROOT )?%([\w.-]+) = [^\n]*?custom-call\([^\n]*tpu_custom_call", text, re.M
        )
    )
    collectives = collections.Counter(
        re.findall(
            r"= [^\n]*? (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(", text
        )
    )
    mem = compiled.memory_analysis()
    return {
        "collectives": dict(collectives),
        "compile_s": seconds,
        "flops": flops,
        "ratio": flops / analytic,
        "kernels": dict(kernels),
        "temp_gib": mem.temp_size_in_bytes / 2**30,
    }


def moe_layer(mesh, tokens_per_device: int, dispatch: str) -> dict:
    """One Qwen3-30B-A3B-sized MoE layer, forward + backward w.r.t. its input and weights."""
    make = lambda: MoE(
        d_model=D_MODEL,
        num_experts=EXPERTS,
        k=TOP_K,
        expert_dim=EXPERT_DIM,
        norm_topk_prob=True,
        dispatch=dispatch,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(nnx.eval_shape(make))
    shardings = sharding.param_shardings(state, mesh)
    params = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        state.to_pure_dict(),
        shardings,
    )
    rows = sharding.batch_axes(mesh)
    t = 1024
    b = tokens_per_device * mesh.size // t
    x = jax.ShapeDtypeStruct(
        (b, t, D_MODEL), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(rows))
    )

    def loss(params, x_btd):
        layer = nnx.merge(graphdef, params)
        out = layer(x_btd, mask_bt=jnp.ones(x_btd.shape[:2], bool))
        return jnp.sum(out.y_btd.astype(jnp.float32) ** 2) + out.balance_loss

    active = 3 * D_MODEL * EXPERT_DIM * TOP_K + D_MODEL * EXPERTS
    return compile_report(
        jax.value_and_grad(loss, argnums=(0, 1)), (params, x), mesh, 6 * active * b * t
    )


def attention(mesh, seq_len: int, path: str) -> dict:
    """Causal GQA attention of Qwen3-30B-A3B's shapes, one row per device, forward + backward."""
    b, g, r = mesh.size, KV_HEADS, HEADS // KV_HEADS
    rows = sharding.batch_axes(mesh)
    spec = lambda *rest: NamedSharding(mesh, PartitionSpec(rows, *rest))
    q = jax.ShapeDtypeStruct((b, seq_len, g, r, HEAD_DIM), jnp.bfloat16, sharding=spec())
    kv = jax.ShapeDtypeStruct((b, seq_len, g, HEAD_DIM), jnp.bfloat16, sharding=spec())
    valid = jax.ShapeDtypeStruct((b, seq_len), jnp.bool_, sharding=spec())

    def loss(q, k, v, valid):
        out = causal_attention(q, k, v, valid, path=path, block=512, dtype=jnp.bfloat16)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    analytic = 3 * 2 * b * HEADS * HEAD_DIM * seq_len**2
    return compile_report(
        jax.value_and_grad(loss, argnums=(0, 1, 2)), (q, kv, kv, valid), mesh, analytic
    )


def tiny_model(mesh) -> dict:
    """The `tiny` preset's forward + backward with attention and dispatch on "auto"."""
    cfg = ModelConfig.preset("tiny")
    graphdef, state = placement.abstract_model(cfg)
    shardings = sharding.param_shardings(state, mesh)
    params = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        state.to_pure_dict(),
        shardings,
    )
    b, t = 2 * mesh.size, 64
    rows = NamedSharding(mesh, PartitionSpec(sharding.batch_axes(mesh)))
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows)

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        out = model.forward(tokens)
        return jnp.sum(model.target_logprobs(out.hidden_btd[:, :-1], tokens[:, 1:]))

    return compile_report(jax.value_and_grad(loss), (params, tokens), mesh, 1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--mesh", default="fsdp=-1")
    parser.add_argument("--tokens", type=int, default=4096, help="MoE tokens per device")
    parser.add_argument("--seq-len", type=int, default=8192, help="attention row length")
    parser.add_argument("--parts", default="moe,attention,tiny")
    parser.add_argument("--moe-paths", default="ragged,gmm,dense")
    parser.add_argument("--attention-paths", default="splash,blockwise,dense")
    args = parser.parse_args(argv)
    devices = tpu_devices(args.topology)
    mesh = sharding.make_mesh(sharding.MeshConfig.parse(args.mesh), devices)
    print(f"{args.topology}: {len(devices)} x {devices[0].device_kind}, mesh {dict(mesh.shape)}")
    parts = set(args.parts.split(","))
    rows = []
    if "moe" in parts:
        for path in args.moe_paths.split(","):
            rows.append(
                (
                    f"MoE layer, {args.tokens} tokens/device",
                    path,
                    moe_layer(mesh, args.tokens, path),
                )
            )
    if "attention" in parts:
        for path in args.attention_paths.split(","):
            rows.append((f"attention, T={args.seq_len}", path, attention(mesh, args.seq_len, path)))
    if "tiny" in parts:
        rows.append(("tiny preset, auto", "auto", tiny_model(mesh)))
    print(
        "| program | path | compiled/analytic FLOPs | temp GiB/device | Mosaic kernels "
        "| collectives | compile s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, path, r in rows:
        kernels = ", ".join(f"{k} x{n}" for k, n in sorted(r["kernels"].items())) or "none"
        ratio = "-" if name.startswith("tiny") else f"{r['ratio']:.2f}"
        comms = ", ".join(f"{k} x{n}" for k, n in sorted(r["collectives"].items())) or "none"
        print(
            f"| {name} | {path} | {ratio} | {r['temp_gib']:.2f} | {kernels} | {comms} "
            f"| {r['compile_s']:.1f} |"
        )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
