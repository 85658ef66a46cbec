"""The mismatch 8-bit serving adds, at lag 0, and the engine's decode speed on CPU, per
``server.weight_dtype`` × ``server.kv_cache_dtype`` (docs/DESIGN.md §6.1).

For each model: the trainer's float32 master params, served in bfloat16 (``server.dtype``) and
quantized by the server's own code (`quant.quantize_params`; the cache by ``DecodeCore``'s
``kv_cache_dtype``). Each configuration samples the same prompts (one slot each, temperature 1,
the same seed) through ``DecodeCore`` and records each token's behavior log-prob, as the rollout
server does. At lag 0 the trainer scores those tokens with its float32 masters
(``Transformer.forward``, full precision); per configuration the table gives:

  * ``sampler_kl``: mean k3 = exp(d) − 1 − d over the tokens, d = trainer logp − behavior logp
    (the trainer's ``sampler_kl`` at lag 0, unclamped);
  * ``|logp - behavior|``: the mean absolute log-ratio (the trainer's ``mismatch_abs_mean``);
  * each as a multiple of the bfloat16 row's (bfloat16 serving: its own mismatch, from the
    bfloat16 weights and the bfloat16 cache beside float32 compute), which isolates what
    quantization adds;
  * decode tokens/s of the engine's step on this CPU (a second pass over the same prompts, after
    compiling; XLA:CPU dequantizes every step, so this is not the TPU figure: see the plan).

Models: the ``small`` preset (random init by the model's initializers, the server's
``placement.init_sharded``) and a Hugging Face Qwen3-MoE checkpoint written here with
``transformers`` (a real ``Qwen3MoeConfig``: head_dim 128, 8 query heads per KV head, top-8 of 32
experts, no tied embeddings; tiny widths; weights drawn wider than HF's init so the logits are
far from uniform) and loaded by ``sat_jax.model.hf``; ``tiny`` (``--lora``, for the tests). Nothing
is downloaded.

    PYTHONPATH=. .venv/bin/python benchmarks/quant.py [--models small,hf] [--slots 8]
        [--new-tokens 48] [--prompt-len 16] [--configs fp8:int8,...]
    PYTHONPATH=. .venv/bin/python benchmarks/quant.py --push [--models small] [--repeats 5]
    PYTHONPATH=. .venv/bin/python benchmarks/quant.py --lora [--models small,hf] [--lora-rank 8]
        [--lora-frac 0.03] [--lora-seed 0] [--configs int8:bfloat16,fp8:bfloat16,fp8:fp8]

``--configs`` runs only the named weights:cache pairs (bfloat16:bfloat16, the ratios' base,
always runs first).

``--push`` measures the two ways an 8-bit server gets its weights (docs/DESIGN.md §6.1), per
weight format, through the code a push runs, in a temporary weights directory: the trainer's
side is ``weight_sync.host_copy`` (cast of the float32 masters to bfloat16, ``server.dtype``,
and, for the pre-quantized push, ``quant.quantize_params`` in the same program; copy to host)
and ``weight_sync.push_weights`` (the flat save, unfsynced); the server's side is
``rollout_server.weights.WeightsLoader.load`` and ``MoEEngine.swap_params`` of an engine with
that ``server.weight_dtype`` (a bfloat16 push is quantized there; a pre-quantized one is
installed as it is). Per way: the bytes written, the seconds ``host_copy`` holds the loop's
thread (its programs are dispatched, not waited for), the trainer's seconds (``host_copy`` and
the save, which waits for them), the server's (load + install), medians over ``--repeats`` after one push that compiles; and whether both ways serve
bit-identical weights.

``--lora`` measures the same lag-0 mismatch for a LoRA run (``model.lora``: rank ``--lora-rank``,
alpha 16, targets attention and experts, the project's defaults and the LoRA recipe's rank 8).
The adapters are non-zero: A as the model draws it (``init_lora``: normal, fan-in scaled), B
normal and then scaled per target so that ||scale · A B|| is ``--lora-frac`` of ||W|| (Frobenius,
over the whole weight, experts stacked), both drawn from ``--lora-seed``. The trainer's policy is
its float32 masters plus the float32 adapters, scored by the LoRA model's own forward
(W + scale · A B, ``lora_weight``). The push is what a LoRA trainer sends: the base and the
adapters cast to bfloat16 (``server.dtype``). Rows per 8-bit weights:cache pair (the bfloat16 row is the ratios' base):

  * ``bfloat16``: the server's LoRA install with ``server.weight_dtype`` bfloat16
    (``WeightsLoader.load``: the adapters merged into the kept base in float32, cast to bfloat16);
  * ``merged``: what the server does with an 8-bit ``weight_dtype``: that merged bfloat16 tree
    quantized as ``MoEEngine.swap_params`` quantizes it (``quant.quantize_params``);
  * ``adapters``: the alternative the server does not implement, an 8-bit base with the adapters
    applied unquantized at run time. Its served weights are computed as such a kernel computes
    them: dequantize(quantize(W)) + scale · A B (``lora.merged_weight``: the product in float32,
    the sum cast to bfloat16, the serving dtype), served unquantized. The cast of the sum rounds
    once to bfloat16, as bfloat16 serving's own weights are rounded.

Beside sampler_kl and |logp - behavior| each row gives the adapted weights' relative error
against the trainer's float32 W + scale · A B (||served − (W + s A B)|| / ||W + s A B||, over
every adapted weight), and, free of sampling noise, the policy KL(trainer || served) over the
whole vocabulary, averaged over the same token sequences for every row (the prompts and the
bfloat16 row's sampled tokens; the served model's full forward, ``full_logp``, with attention
over an 8-bit cache's keys and values for an 8-bit ``cache``): the sampled columns differ
between rows also because each row samples other tokens.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax import decoding, quant, sharding
from sat_jax.model import ModelConfig, Transformer, hf, placement

HF_CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=128,
    num_experts=32,
    num_experts_per_tok=8,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    vocab_size=4096,
)


LORA_ALPHA = 16.0
LORA_TARGETS = ("attention", "experts")


def tiny_model(seed: int = 0):
    """(config, float32 params) of the ``tiny`` preset, randomly initialized (tests)."""
    cfg = ModelConfig.preset("tiny", dispatch="dense")
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    return cfg, placement.init_sharded(cfg, mesh, seed)[1]


def small_model(seed: int = 0):
    """(graphdef, float32 master params) of the ``small`` preset, randomly initialized."""
    cfg = ModelConfig.preset("small", dispatch="dense")
    mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
    _, params = placement.init_sharded(cfg, mesh, seed)  # a pure dict
    return cfg, params


def hf_model(tmp: pathlib.Path, seed: int = 0):
    """(config, graphdef, float32 params) of a Qwen3-MoE checkpoint written with transformers."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(str(tmp))
    loaded = hf.load_qwen3_moe(tmp, dispatch="dense")
    return loaded.config, nnx.to_pure_dict(nnx.state(loaded))


def sample(cfg, graphdef, served, kv, prompts, new_tokens, seed=0, timed=True):
    """(tokens [B, N], behavior log-probs [B, N], decode tokens/s of the timed pass); without
    ``timed`` one pass only (its tokens/s include the compiles)."""
    slots, p = prompts.shape
    core = decoding.DecodeCore(
        graphdef,
        cfg,
        slots=slots,
        max_prefill_length=p,
        max_decode_length=new_tokens,
        sampling=decoding.SamplingConfig(),
        sampleable_v=np.ones((cfg.vocab_size,), bool),
        seed=seed,
        kv_cache_dtype=kv,
    )

    def one_pass():
        state = core.init_state()
        for slot in range(slots):
            prefix = core.prefill_prompt(served, prompts[slot].tolist())
            state = core.insert(prefix, state, slot)
        rows = []
        start = time.perf_counter()
        for _ in range(new_tokens):
            state, data = core.generate(served, state, jnp.int32(0))
            rows.append(decoding.unpack_step(data, cfg.num_moe_layers, cfg.num_experts_per_tok))
        seconds = time.perf_counter() - start
        tokens = np.stack([r["token"] for r in rows], 1)
        logp = np.stack([r["logp"] for r in rows], 1)
        return tokens, logp, slots * new_tokens / seconds

    first = one_pass()  # compiles every window
    if not timed:
        return first
    second = one_pass()
    np.testing.assert_array_equal(first[0], second[0])
    return second


def scored(graphdef, params, prompts, tokens):
    """Full-forward log-probs [B, N] of ``tokens`` after ``prompts`` under ``params``."""
    seq = jnp.concatenate([prompts, tokens], 1).astype(jnp.int32)
    logits = nnx.merge(graphdef, params)(seq)
    p = prompts.shape[1]
    logp = jax.nn.log_softmax(logits[:, p - 1 : -1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]


def k3(d: np.ndarray) -> float:
    return float(np.mean(np.exp(d) - 1.0 - d))


def _graphdef(cfg: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]


def _push_engine(cfg, masters, fmt):
    """A rollout engine serving ``masters`` in bfloat16 (``server.dtype``), ``weight_dtype`` fmt."""
    from rollout_server.engine import MoEEngine
    from sat_jax.tasks import CharTokenizer

    bf16_cfg = cfg.replace(param_dtype=jnp.bfloat16)
    served = jax.tree.map(lambda x: x.astype(jnp.bfloat16), masters)
    return MoEEngine(
        nnx.merge(_graphdef(bf16_cfg), served),
        tokenizer=CharTokenizer("0123456789+-*=() "),
        slots=1,
        max_prefill_length=16,
        max_decode_length=4,
        sampling=decoding.SamplingConfig(),
        weight_dtype=fmt,
    )


def push_model(name, cfg, masters, args) -> list[str]:
    """The ``--push`` table rows of one model (see the module docstring)."""
    import statistics

    from rollout_server.weights import WeightsLoader
    from sat_jax import params_io
    from sat_jax.model.config import LoRAConfig
    from train import weight_sync

    lines = []
    for fmt in ("int8", "fp8"):
        installed = {}
        for pushed in ("bfloat16", fmt):
            engine = _push_engine(cfg, masters, fmt)
            copies, saves, loads, nbytes = [], [], [], 0
            with tempfile.TemporaryDirectory() as tmp:
                loader = WeightsLoader(tmp, LoRAConfig())
                for version in range(1, args.repeats + 2):  # the first compiles
                    start = time.perf_counter()
                    copy = weight_sync.host_copy(masters, jnp.bfloat16, pushed)
                    copied = time.perf_counter()  # what the loop's thread waits for
                    weight_sync.push_weights(None, copy, version, tmp)
                    mid = time.perf_counter()
                    path = str(pathlib.Path(tmp) / f"v{version}")
                    loaded = loader.load(path, "", engine.current_params()[1])
                    engine.swap_params(version, loaded.params)
                    end = time.perf_counter()
                    if version > 1:
                        copies.append(copied - start)
                        saves.append(mid - start)
                        loads.append(end - mid)
                    nbytes = (pathlib.Path(path) / params_io.FLAT_DATA).stat().st_size
                    assert params_io.stored_weight_dtype(path) == pushed
            installed[pushed] = engine.served_params()[1]
            way = "bfloat16, server quantizes" if pushed == "bfloat16" else f"{fmt} (built path)"
            save, load = statistics.median(saves), statistics.median(loads)
            lines.append(
                f"| {name} | {fmt} | {way} | {nbytes / 2**20:,.2f} MiB | "
                f"{statistics.median(copies) * 1e3:,.1f} ms | {save * 1e3:,.0f} ms | "
                f"{load * 1e3:,.0f} ms | {(save + load) * 1e3:,.0f} ms |"
            )
            print(lines[-1], flush=True)
        a, b = installed.values()
        same = all(
            np.array_equal(np.asarray(x), np.asarray(y))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )
        print(f"| {name} | {fmt} | both install bit-identical weights: {same} | | | | | |")
    return lines


def _configs(spec: str | None) -> list[tuple[str, str]]:
    """The (weights, cache) pairs to run: all, or bfloat16:bfloat16 and ``spec``'s."""
    pairs = list(itertools.product(quant.FORMATS, quant.FORMATS))
    if not spec:
        return pairs
    chosen = [tuple(x.split(":")) for x in spec.split(",")]
    for pair in chosen:
        if pair not in pairs:
            raise SystemExit(f"--configs: {':'.join(pair)} is not weights:cache of {quant.FORMATS}")
    return [("bfloat16", "bfloat16"), *[p for p in chosen if p != ("bfloat16", "bfloat16")]]


def run_model(name, cfg, masters, args) -> list[str]:
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, cfg.vocab_size, (args.slots, args.prompt_len)).astype(np.int32)
    masters = jax.tree.map(lambda x: x.astype(jnp.float32), masters)
    bf16_cfg = cfg.replace(param_dtype=jnp.bfloat16)
    graphdef = _graphdef(bf16_cfg)  # the server's model: bfloat16 weights (server.dtype)
    served_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), masters)
    master_graph = _graphdef(cfg.replace(param_dtype=jnp.float32))
    score = jax.jit(lambda g, p, s, t: scored(g, p, s, t), static_argnums=0)
    score_master = lambda p, s, t: np.asarray(score(master_graph, p, s, t))
    lines, base = [], None
    for w, kv in _configs(args.configs):
        served = jax.jit(lambda p, w=w: quant.quantize_params(p, w))(served_bf16)
        tokens, behavior, tps = sample(bf16_cfg, graphdef, served, kv, prompts, args.new_tokens)
        trainer = score_master(masters, prompts, tokens)
        d = trainer - behavior
        kl, mean_abs = k3(d), float(np.abs(d).mean())
        base = (kl, mean_abs) if base is None else base
        lines.append(
            f"| {name} | {w} | {kv} | {kl:.2e} | {kl / base[0]:.1f}x | {mean_abs:.4f} | "
            f"{mean_abs / base[1]:.1f}x | {tps:,.0f} |"
        )
        print(lines[-1], flush=True)
    return lines


def lora_adapters(cfg: ModelConfig, masters, lora, frac: float, seed: int = 0) -> dict:
    """Float32 LoRA adapters of ``cfg.replace(lora=lora)`` for ``masters``, non-zero: A as the
    model draws it (``init_lora``), B normal, then scaled per target so that
    ||lora.scale · A B||_F = ``frac`` · ||W||_F."""
    from flax import traverse_util

    from sat_jax.model.layers import LORA_A, LORA_B, lora_delta
    from sat_jax.model.lora import init_lora

    lora_cfg = cfg.replace(param_dtype=jnp.float32, lora=lora)
    fresh = traverse_util.flatten_dict(init_lora(lora_cfg, rng=seed))
    base = traverse_util.flatten_dict(masters)
    rng = np.random.default_rng(seed)
    out = {}
    for path, a in fresh.items():
        if not path[-1].endswith(LORA_A):
            continue
        target = (*path[:-1], path[-1][: -len(LORA_A)])
        b_path = (*path[:-1], target[-1] + LORA_B)
        w = jnp.asarray(base[target], jnp.float32)
        b = jnp.asarray(rng.standard_normal(fresh[b_path].shape), jnp.float32)
        delta = lora.scale * lora_delta(a, b, w.ndim)
        b = b * (frac * jnp.linalg.norm(w) / jnp.linalg.norm(delta))
        out[path], out[b_path] = a, b
    return traverse_util.unflatten_dict(out)


def lora_served(cfg: ModelConfig, masters, adapters, lora, fmt: str, way: str, tmp) -> dict:
    """The weights a server with ``server.weight_dtype`` ``fmt`` serves for the LoRA push of
    ``masters`` + ``adapters`` (both pushed in bfloat16), one ``way`` (the module docstring):
    "merged" (the server's install: ``WeightsLoader.load`` over the kept base, then
    ``quant.quantize_params`` as ``MoEEngine.swap_params`` does; bfloat16 for ``fmt`` bfloat16)
    or "adapters" (dequantize(quantize(W)) + scale · A B, cast to bfloat16)."""
    from flax import traverse_util

    from rollout_server.weights import WeightsLoader
    from sat_jax import params_io
    from sat_jax.model.layers import LORA_A, LORA_B
    from sat_jax.model.lora import abstract_adapters, merged_weight
    from train.weight_sync import host_copy

    base = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), masters)
    pushed = host_copy(adapters, jnp.bfloat16)
    if way == "merged":
        tmp = pathlib.Path(tmp)
        if not (tmp / "base").exists():  # the same push for every row
            params_io.save_params(tmp / "base", host_copy(masters, jnp.bfloat16))
            params_io.save_params(tmp / "adapters", pushed)
        mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
        like = abstract_adapters(cfg.replace(param_dtype=jnp.bfloat16, lora=lora), mesh)
        loader = WeightsLoader(str(tmp), lora, like)
        merged = loader.load(str(tmp / "adapters"), str(tmp / "base"), base).params
        return jax.jit(lambda p: quant.quantize_params(p, fmt))(merged)
    if way != "adapters":
        raise ValueError(f"way must be 'merged' or 'adapters', got {way!r}")
    deq = jax.jit(lambda p: quant.dequantize_params(quant.quantize_params(p, fmt)))(base)
    flat = traverse_util.flatten_dict(deq)
    ad = traverse_util.flatten_dict(jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), pushed))
    for path in [p for p in ad if p[-1].endswith(LORA_A)]:
        target = (*path[:-1], path[-1][: -len(LORA_A)])
        b = ad[(*path[:-1], target[-1] + LORA_B)]
        flat[target] = merged_weight(flat[target], ad[path], b, jnp.float32(lora.scale))
    return traverse_util.unflatten_dict(flat)


def adapted_error(served, masters, adapters, lora) -> float:
    """||served − (W + scale · A B)|| / ||W + scale · A B|| over every adapted weight, float32
    against the trainer's float32 masters and adapters (``served`` dequantized)."""
    from flax import traverse_util

    from sat_jax.model.layers import LORA_A, LORA_B
    from sat_jax.model.lora import merged_weight

    flat = traverse_util.flatten_dict(quant.dequantize_params(served))
    base = traverse_util.flatten_dict(masters)
    ad = traverse_util.flatten_dict(adapters)
    err = norm = 0.0
    for path in [p for p in ad if p[-1].endswith(LORA_A)]:
        target = (*path[:-1], path[-1][: -len(LORA_A)])
        b = ad[(*path[:-1], target[-1] + LORA_B)]
        want = merged_weight(jnp.asarray(base[target], jnp.float32), ad[path], b, lora.scale)
        err += float(jnp.sum((flat[target].astype(jnp.float32) - want) ** 2))
        norm += float(jnp.sum(want**2))
    return (err / norm) ** 0.5


def full_logp(graphdef, params, seq, prompt_len: int, kv: str = "bfloat16") -> jax.Array:
    """Log-probs [B, N, V] of every next token after the prompt of ``seq`` (full forward of
    ``params``, dequantized; attention over an 8-bit cache's keys and values for ``kv``)."""
    model = nnx.merge(graphdef, quant.dequantize_params(params))
    logits = model.forward(seq, kv_cache_dtype=kv).logits_btv[:, prompt_len - 1 : -1]
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _lora_configs(spec: str | None) -> list[tuple[str, str]]:
    """The 8-bit (weights, cache) pairs of ``--lora``: ``spec``'s, default int8 and fp8 weights
    with a bfloat16 cache and fp8 weights with an fp8 cache (the frontier's 8-bit rollouts)."""
    pairs = _configs(spec or "int8:bfloat16,fp8:bfloat16,fp8:fp8")[1:]
    if any(not quant.is_quantized(w) for w, _ in pairs):
        raise SystemExit("--lora --configs: name 8-bit weights (the bfloat16 row always runs)")
    return pairs


def run_lora(name, cfg, masters, args) -> list[str]:
    """The ``--lora`` table rows of one model (see the module docstring)."""
    from sat_jax.model.config import LoRAConfig
    from sat_jax.model.lora import join_lora

    lora = LoRAConfig(rank=args.lora_rank, alpha=LORA_ALPHA, targets=LORA_TARGETS)
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, cfg.vocab_size, (args.slots, args.prompt_len)).astype(np.int32)
    masters = jax.tree.map(lambda x: x.astype(jnp.float32), masters)
    adapters = lora_adapters(cfg, masters, lora, args.lora_frac, args.lora_seed)
    bf16_cfg = cfg.replace(param_dtype=jnp.bfloat16)
    graphdef = _graphdef(bf16_cfg)
    trainer_graph = _graphdef(cfg.replace(param_dtype=jnp.float32, lora=lora))
    trainer_params = join_lora(masters, adapters)
    score = jax.jit(lambda p, s, t: scored(trainer_graph, p, s, t))
    served_logp = jax.jit(
        lambda p, s, kv: full_logp(graphdef, p, s, args.prompt_len, kv), static_argnums=2
    )
    rows = [("bfloat16", "bfloat16", "merged")]
    rows += [
        (w, kv, way) for w, kv in _lora_configs(args.configs) for way in ("merged", "adapters")
    ]
    lines, base, fixed = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for w, kv, way in rows:
            served = lora_served(cfg, masters, adapters, lora, w, way, tmp)
            err = adapted_error(served, masters, adapters, lora)
            tokens, behavior, _ = sample(
                bf16_cfg, graphdef, served, kv, prompts, args.new_tokens, timed=False
            )
            d = np.asarray(score(trainer_params, prompts, tokens)) - behavior
            if fixed is None:  # the bfloat16 row's tokens: the same sequences for every row
                fixed = jnp.asarray(np.concatenate([prompts, tokens], 1), jnp.int32)
                trainer_logp = full_logp(trainer_graph, trainer_params, fixed, args.prompt_len)
            logp = served_logp(served, fixed, kv)
            policy = float(jnp.mean(jnp.sum(jnp.exp(trainer_logp) * (trainer_logp - logp), -1)))
            kl, mean_abs = k3(d), float(np.abs(d).mean())
            base = (kl, mean_abs, policy) if base is None else base
            label = "bfloat16 (W + BA)" if w == "bfloat16" else way
            lines.append(
                f"| {name} | {w} | {kv} | {label} | {err:.2e} | {kl:.2e} | {kl / base[0]:.1f}x | "
                f"{mean_abs:.4f} | {mean_abs / base[1]:.1f}x | {policy:.2e} | "
                f"{policy / base[2]:.1f}x |"
            )
            print(lines[-1], flush=True)
    return lines


def _model(name: str, tmp: str):
    """(config, params) of ``--models``' ``name``: small, hf (written under ``tmp``) or tiny."""
    if name == "small":
        return small_model()
    if name == "hf":
        return hf_model(pathlib.Path(tmp))
    if name == "tiny":
        return tiny_model()
    raise SystemExit(f"--models: unknown model {name!r} (small, hf, tiny)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="small,hf")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--configs", help="weights:cache pairs (comma-separated); default all")
    parser.add_argument("--push", action="store_true", help="measure the two push formats")
    parser.add_argument("--repeats", type=int, default=5, help="--push: timed pushes per way")
    parser.add_argument("--lora", action="store_true", help="the mismatch of a LoRA run's pushes")
    parser.add_argument("--lora-rank", type=int, default=8, help="--lora: model.lora.rank")
    parser.add_argument(
        "--lora-frac", type=float, default=0.03, help="--lora: ||scale·A B|| / ||W|| per target"
    )
    parser.add_argument("--lora-seed", type=int, default=0, help="--lora: the adapters' draw")
    args = parser.parse_args(argv)
    _configs(args.configs)  # refuse a bad pair before building any model
    if args.lora:
        _lora_configs(args.configs)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.lora:
        print(
            "| model | weights | cache | adapters | adapted weights' rel. error | sampler_kl | "
            "vs bf16 | mean abs(logp - behavior) | vs bf16 | KL(trainer || served), fixed tokens "
            "| vs bf16 |"
        )
        print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name in args.models.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                run_lora("hf qwen3-moe" if name == "hf" else name, *_model(name, tmp), args)
        return 0
    if args.push:
        print("| model | format | push | bytes | loop thread | trainer | server | end to end |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for name in args.models.split(","):
            if name == "small":
                cfg, masters = small_model()
            elif name == "hf":
                tmp = tempfile.TemporaryDirectory()
                cfg, masters = hf_model(pathlib.Path(tmp.name))
            else:
                raise SystemExit(f"--models: unknown model {name!r} (small, hf)")
            push_model(name, cfg, jax.tree.map(lambda x: x.astype(jnp.float32), masters), args)
        return 0
    print(
        "| model | weights | cache | sampler_kl | vs bf16 | mean abs(logp - behavior) | vs bf16 "
        "| decode tokens/s (CPU) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        if name == "small":
            run_model("small", *small_model(), args)
        elif name == "hf":
            with tempfile.TemporaryDirectory() as tmp:
                run_model("hf qwen3-moe", *hf_model(pathlib.Path(tmp)), args)
        else:
            raise SystemExit(f"--models: unknown model {name!r} (small, hf)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
