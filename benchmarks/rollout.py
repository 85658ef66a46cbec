"""Rollout-server speeds: engine decode vs a naive recompute decoder vs HF generate; weight swap
time vs checkpoint bytes; Pull throughput over real gRPC and routing bytes per token (docs/DESIGN.md §9).

Run: `python benchmarks/rollout.py` (a few minutes on 2 CPU cores); `--quick` for a smoke run;
`--engine [--preset small --dtype bfloat16 --slots 32 --new-tokens 128]` for the engine's decode
tokens/s alone (the accelerator check, `benchmarks/gpu_check.sh`); `--wire` for the wire's figures
alone (`bench_wire`).

- decode: tokens/s of `MoEEngine.generate` (KV cache, B slots) on the tiny preset, against a
  jitted naive decoder that recomputes the full forward of the whole padded sequence every step,
  and against `transformers` `Qwen3MoeForCausalLM.generate` (random weights, same config, KV
  cache, sampling) when transformers and torch are installed. Same B, prompt and new tokens.
- group: one group of G samples of one long prompt (prefill + insert into G slots + decode), as
  the server runs it: `MoEEngine.prefill` (one prefill per group, `DecodeCore.prefill_once`)
  against a prefill per sample (`DecodeCore.prefill` G times), and against HF `generate` of the
  same G rows (which prefills each row). Tokens/s counts the G·new generated tokens over the
  whole group's wall time.
- window: `DecodeCore` decode steps over `decode_window()` against steps over the whole cache,
  short sequences in a cache of 1,025 positions.
- swap: `params_io.load_params` (orbax restore) and `MoEEngine.swap_params` for checkpoints of the
  tiny preset and of wider tiny variants, against the checkpoint's bytes.
- pull: a `PullResponse` of Qwen3-30B-A3B-shaped trajectories (48 MoE layers, top-8, uint8
  routing) served by an in-process gRPC server with the same 256 MB limits; MB/s of the client's
  Pull, and the routing bytes per token.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import statistics
import sys
import tempfile
import time

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollout_api import records
from rollout_api.client import channel_options, connect
from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
from rollout_server.engine import MoEEngine
from rollout_server.service import pull_reply
from sat_jax import params_io
from sat_jax.config import RolloutConfig, ServerConfig
from sat_jax.decoding import DecodeCore, SamplingConfig, sample
from sat_jax.model import ModelConfig, Transformer
from sat_jax.tasks import CharTokenizer

TOK = CharTokenizer("0123456789+-*=() ")


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# The server's message limit (its one home is ServerConfig).
MAX_MESSAGE_BYTES = ServerConfig().max_message_bytes


def bench_engine(
    cfg: ModelConfig, slots: int, prompt_len: int, new_tokens: int, repeats: int
) -> float:
    engine = MoEEngine(
        Transformer(cfg, rngs=nnx.Rngs(0)),
        tokenizer=TOK,
        slots=slots,
        max_prefill_length=16,
        max_decode_length=new_tokens,
        sampling=SamplingConfig.from_rollout(RolloutConfig()),
    )
    ids = np.array([TOK.bos_id, *([5] * (prompt_len - 1))], np.int32)
    padded = np.pad(ids, (0, 16 - len(ids)))

    def run():
        state = engine.init_decode_state()
        for slot in range(slots):
            prefix = engine.prefill(padded_tokens=padded, true_length=len(ids))
            state = engine.insert(prefix, state, slot)
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(new_tokens):
            state, result = engine.generate(None, state)
            np.asarray(result.data)  # the orchestrator copies every step to host
        run.decode_s = time.perf_counter() - start

    run()  # warm-up: compiles
    secs = []
    for _ in range(repeats):
        run()
        secs.append(run.decode_s)
    return slots * new_tokens / statistics.median(secs)


def bench_group(
    cfg: ModelConfig, group: int, prompt_len: int, new_tokens: int, repeats: int
) -> tuple[float, float]:
    """Tokens/s of one group end to end: (one prefill per group, one prefill per sample)."""
    engine = MoEEngine(
        Transformer(cfg, rngs=nnx.Rngs(0)),
        tokenizer=TOK,
        slots=group,
        max_prefill_length=prompt_len,
        max_decode_length=new_tokens,
        sampling=SamplingConfig.from_rollout(RolloutConfig()),
    )
    params = engine.current_params()[1]

    def run(per_sample: bool) -> float:
        # A prompt unlike the previous run's, so the first prefill of a group is a real one.
        run.n = getattr(run, "n", 0) + 1
        ids = np.array([TOK.bos_id, *([5] * (prompt_len - 2)), 3 + run.n % 2], np.int32)
        state = engine.init_decode_state()
        jax.block_until_ready(state)
        start = time.perf_counter()
        for slot in range(group):
            if per_sample:
                prefix = engine.core.prefill(
                    params, jnp.asarray(ids), jnp.int32(prompt_len), jnp.int32(0)
                )
            else:
                prefix = engine.prefill(padded_tokens=ids, true_length=prompt_len)
            state = engine.insert(prefix, state, slot)
        for _ in range(new_tokens):
            state, result = engine.generate(None, state)
            np.asarray(result.data)
        return time.perf_counter() - start

    run(False), run(True)  # warm-up: compiles
    secs_once, secs_each = [], []
    for _ in range(repeats):  # interleaved, so load changes hit both alike
        secs_once.append(run(False))
        secs_each.append(run(True))
    tokens = group * new_tokens
    return tokens / statistics.median(secs_once), tokens / statistics.median(secs_each)


def bench_window(
    cfg: ModelConfig, slots: int, prompt_len: int, new_tokens: int, capacity: int, repeats: int
) -> tuple[float, float]:
    """Decode tokens/s of `DecodeCore` with a cache of `capacity` positions holding short
    sequences: (steps over `decode_window()`, steps over the whole cache)."""
    model = Transformer(cfg.replace(max_seq_len=capacity), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    core = DecodeCore(
        graphdef,
        model.config,
        slots=slots,
        max_prefill_length=16,
        max_decode_length=capacity - 17,
        sampling=SamplingConfig.from_rollout(RolloutConfig()),
        sampleable_v=np.ones((cfg.vocab_size,), bool),
    )
    ids = [TOK.bos_id, *([5] * (prompt_len - 1))]

    def run(windowed: bool) -> float:
        state = core.init_state()
        for slot in range(slots):
            state = core.insert(core.prefill_prompt(params, ids), state, slot)
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(new_tokens):
            if windowed:
                state, data = core.generate(params, state, 0)
            else:
                state, data = core.generate_step(params, state, jnp.int32(0), core.cache_length)
            np.asarray(data)
        return time.perf_counter() - start

    run(True), run(False)  # warm-up: compiles
    secs_window, secs_full = [], []
    for _ in range(repeats):
        secs_window.append(run(True))
        secs_full.append(run(False))
    tokens = slots * new_tokens
    return tokens / statistics.median(secs_window), tokens / statistics.median(secs_full)


def bench_naive(
    cfg: ModelConfig, slots: int, prompt_len: int, new_tokens: int, repeats: int
) -> float:
    """Full forward over the whole [B, prompt + new] padded sequence for every new token."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    total = prompt_len + new_tokens
    sampling = SamplingConfig.from_rollout(RolloutConfig())

    @jax.jit
    def step(params, seq_bt, t, key):
        logits_btv = nnx.merge(graphdef, params)(seq_bt)
        tokens_b, _, _ = sample(logits_btv[:, t - 1], key, sampling)
        return seq_bt.at[:, t].set(tokens_b)

    def run():
        seq = jnp.full((slots, total), 5, jnp.int32)
        key = jax.random.key(0)
        for t in range(prompt_len, total):
            seq = step(params, seq, t, jax.random.fold_in(key, t))
            np.asarray(seq[:, t])
        return seq

    return slots * new_tokens / _timed(run, repeats)


def bench_hf(
    cfg: ModelConfig, slots: int, prompt_len: int, new_tokens: int, repeats: int
) -> float | None:
    try:
        import torch
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError:
        return None
    hf_cfg = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.expert_dim,
        intermediate_size=cfg.dense_dim,
        norm_topk_prob=cfg.norm_topk_prob,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_seq_len,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_cfg).eval()
    inputs = torch.full((slots, prompt_len), 5, dtype=torch.long)

    def run():
        with torch.no_grad():
            model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )

    return slots * new_tokens / _timed(run, repeats)


def _scaled_params(cfg: ModelConfig) -> dict:
    abstract = nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    )
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * 0.02), abstract
    )


def bench_swap(cfg: ModelConfig, repeats: int) -> tuple[int, float, float]:
    params = _scaled_params(cfg)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    engine = MoEEngine(
        nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0], params),
        tokenizer=TOK,
        slots=2,
        max_prefill_length=16,
        max_decode_length=4,
        sampling=SamplingConfig.from_rollout(RolloutConfig()),
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "ckpt"
        params_io.save_params(path, params)
        like = engine.current_params()[1]
        load_s = _timed(lambda: jax.block_until_ready(params_io.load_params(path, like)), repeats)
        new = params_io.load_params(path, like)
        swap_s = _timed(lambda: engine.swap_params(1, new), repeats)
    return nbytes, load_s, swap_s


class _FixedRollout(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, response: rollout_pb2.PullResponse):
        self.response = response

    def Pull(self, request, context):
        return self.response


def bench_pull(
    groups: int, group_size: int, prompt_len: int, completion_len: int, repeats: int
) -> tuple[float, float, int]:
    """(MB/s, MB per response, routing bytes per token) of Qwen3-30B-A3B-shaped trajectories."""
    layers, k = 48, 8
    rng = np.random.default_rng(0)
    total = prompt_len + completion_len
    trajectories = [
        rollout_pb2.Trajectory(
            prompt_ids=rng.integers(0, 151_936, prompt_len).tolist(),
            completion_ids=rng.integers(0, 151_936, completion_len).tolist(),
            behavior_logprobs=(-rng.random(completion_len)).tolist(),
            versions=[7] * completion_len,
            routing=rollout_pb2.Routing(
                data=rng.integers(0, 128, (total, layers, k), np.uint8).tobytes(),
                shape=[total, layers, k],
                dtype="uint8",
            ),
            reward=1.0,
            finish_reason=rollout_pb2.FINISH_REASON_EOS,
        )
        for _ in range(group_size)
    ]
    response = rollout_pb2.PullResponse(
        groups=[
            rollout_pb2.Group(group_id=i, prompt_id=str(i), trajectories=trajectories)
            for i in range(groups)
        ]
    )
    size = response.ByteSize()
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(2), options=channel_options(MAX_MESSAGE_BYTES)
    )
    rollout_pb2_grpc.add_RolloutServicer_to_server(_FixedRollout(response), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel, stub = connect(f"127.0.0.1:{port}", MAX_MESSAGE_BYTES)
        secs = _timed(lambda: stub.Pull(rollout_pb2.PullRequest(max_groups=groups)), repeats)
        channel.close()
    finally:
        server.stop(None)
    return size / secs / 1e6, size / 1e6, layers * k


def wire_groups(
    groups: int, group_size: int, prompt_len: int, completion_len: int, routing: bool
) -> list[records.Group]:
    """Server-side records of Qwen3-30B-A3B-shaped trajectories (vocabulary 151,936; with
    `routing`, 48 MoE layers top-8 of 128 experts, uint8), with texts of ~4 characters a token."""
    rng = np.random.default_rng(0)
    total = prompt_len + completion_len
    out = []
    for g in range(groups):
        prompt = rng.integers(0, 151_936, prompt_len).astype(np.int32)
        trajectories = tuple(
            records.Trajectory(
                prompt_ids=prompt,
                completion_ids=rng.integers(0, 151_936, completion_len).astype(np.int32),
                behavior_logprobs=(-rng.random(completion_len)).astype(np.float32),
                versions=np.full(completion_len, 7, np.int64),
                routing=rng.integers(0, 128, (total, 48, 8), np.uint8) if routing else None,
                reward=1.0,
                finish_reason="stop",
                completion_text="abcd" * completion_len,
            )
            for _ in range(group_size)
        )
        out.append(
            records.Group(
                group_id=g,
                prompt_id=str(g),
                server_id="bench",
                prompt_text="abcd" * prompt_len,
                answer="42",
                trajectories=trajectories,
            )
        )
    return out


class _QueuedRollout(rollout_pb2_grpc.RolloutServicer):
    """Serves the same queued group messages (the server's `records.to_proto`) on every Pull."""

    def __init__(self, messages: list):
        self.messages = messages

    def Pull(self, request, context):
        return pull_reply(self.messages, request, 0.0)


def bench_wire(
    groups: int, group_size: int, prompt_len: int, completion_len: int, routing: bool, repeats: int
) -> dict[str, float]:
    """One wire's figures: the server's CPU s per 1,000 groups (`records.to_proto` where a
    group is queued, the Pull reply and its serialization), the trainer's (parse and
    `records.decode_pulled` with the model's limits), and a real gRPC Pull's throughput, groups/s
    and MB/s, the client's decoding included. Medians of `repeats` after a warm-up; CPU is this
    thread's (`time.thread_time`)."""
    recs = wire_groups(groups, group_size, prompt_len, completion_len, routing)
    limits = records.GroupLimits(
        vocab_size=151_936, num_experts=128, routing_lk=(48, 8) if routing else None
    )
    request = rollout_pb2.PullRequest(max_groups=groups)

    def server_side() -> bytes:
        return pull_reply([records.to_proto(g) for g in recs], request, 0.0).SerializeToString()

    data = server_side()

    def trainer_side() -> None:
        records.decode_pulled(rollout_pb2.PullResponse.FromString(data).groups, limits)

    def cpu(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
        return statistics.median(times) * 1000 / groups

    server_cpu, trainer_cpu = cpu(server_side), cpu(trainer_side)
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(2), options=channel_options(MAX_MESSAGE_BYTES)
    )
    messages = [records.to_proto(g) for g in recs]
    rollout_pb2_grpc.add_RolloutServicer_to_server(_QueuedRollout(messages), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel, stub = connect(f"127.0.0.1:{port}", MAX_MESSAGE_BYTES)
        secs = _timed(lambda: records.decode_pulled(stub.Pull(request).groups, limits), repeats)
        channel.close()
    finally:
        server.stop(None)
    return {
        "mb": len(data) / 1e6,
        "groups_per_s": groups / secs,
        "mb_per_s": len(data) / secs / 1e6,
        "server_cpu_s_per_1000": server_cpu,
        "trainer_cpu_s_per_1000": trainer_cpu,
    }


def wire_only(repeats: int) -> None:
    """The wire's figures (`bench_wire`) for a routed and an unrouted trajectory shape."""
    print(
        "| Pull of 16 groups x 8 | MB | groups/s | MB/s | server CPU s / 1,000 groups | "
        "trainer CPU s / 1,000 groups |\n| --- | --- | --- | --- | --- | --- |"
    )
    for name, routing in (("prompt 128 + 1,024, routing 48x8", True), ("same, no routing", False)):
        r = bench_wire(16, 8, 128, 1024, routing, repeats)
        print(
            f"| {name} | {r['mb']:.1f} | {r['groups_per_s']:.0f} | {r['mb_per_s']:.0f} | "
            f"{r['server_cpu_s_per_1000']:.2f} | {r['trainer_cpu_s_per_1000']:.2f} |",
            flush=True,
        )


def engine_only(args: argparse.Namespace, repeats: int) -> None:
    """The engine's decode tokens/s for one preset, serving dtype and slot count (random
    weights, an 8-token prompt), e.g. on an accelerator."""
    if args.slots <= 0 or args.new_tokens <= 0:
        raise SystemExit("--slots and --new-tokens must be positive")
    cfg = ModelConfig.preset(
        args.preset, dtype=args.dtype, param_dtype=args.dtype, max_seq_len=16 + args.new_tokens + 1
    )
    tps = bench_engine(cfg, args.slots, 8, args.new_tokens, repeats)
    print(
        f"devices: {jax.devices()}; preset {args.preset}, {args.dtype}, B={args.slots}, "
        f"prompt 8, new {args.new_tokens}: MoEEngine decode {tps:.0f} tokens/s "
        f"(median of {repeats})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="only the engine's decode tokens/s, for --preset/--dtype/--slots/--new-tokens",
    )
    parser.add_argument(
        "--wire", action="store_true", help="only the wire's figures (`bench_wire`)"
    )
    parser.add_argument("--preset", default="small", help="--engine: model preset")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="--engine: dtype"
    )
    parser.add_argument("--slots", type=int, default=32, help="--engine: decode slots")
    parser.add_argument("--new-tokens", type=int, default=128, help="--engine: tokens per slot")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    if args.engine:
        engine_only(args, repeats)
        return
    if args.wire:
        wire_only(repeats)
        return
    cfg = ModelConfig.preset("tiny")
    slots, prompt_len, new_tokens = 8, 8, 16 if args.quick else 64
    print(
        f"devices: {jax.devices()}; tiny preset, B={slots}, prompt {prompt_len}, new {new_tokens}"
    )
    print("\n| decoder | tokens/s | vs engine |\n| --- | --- | --- |")
    engine_tps = bench_engine(
        cfg.replace(max_seq_len=16 + new_tokens + 1), slots, prompt_len, new_tokens, repeats
    )
    rows = [
        ("MoEEngine (KV cache)", engine_tps),
        ("naive full recompute", bench_naive(cfg, slots, prompt_len, new_tokens, repeats)),
    ]
    hf = bench_hf(cfg, slots, prompt_len, new_tokens, repeats)
    rows.append(("HF transformers generate", hf))
    for name, tps in rows:
        print(
            f"| {name} | {'n/a' if tps is None else f'{tps:.0f}'} | "
            f"{'n/a' if tps is None else f'{tps / engine_tps:.2f}x'} |"
        )

    group, long_prompt, group_new = 8, 256, 16 if args.quick else 32
    long_cfg = cfg.replace(max_seq_len=long_prompt + group_new + 1)
    once_tps, each_tps = bench_group(long_cfg, group, long_prompt, group_new, repeats)
    hf_group = bench_hf(long_cfg, group, long_prompt, group_new, repeats)
    print(
        f"\nG={group}, prompt {long_prompt} (max_prefill_length {long_prompt}), new {group_new}"
        "\n| group rollout | tokens/s | vs one prefill per group |\n| --- | --- | --- |"
    )
    for name, tps in [
        ("MoEEngine, one prefill per group", once_tps),
        ("MoEEngine, one prefill per sample", each_tps),
        ("HF transformers generate", hf_group),
    ]:
        print(
            f"| {name} | {'n/a' if tps is None else f'{tps:.0f}'} | "
            f"{'n/a' if tps is None else f'{tps / once_tps:.2f}x'} |"
        )

    capacity = 257 if args.quick else 1025
    window_tps, full_tps = bench_window(cfg, slots, prompt_len, new_tokens, capacity, repeats)
    print(
        f"\nB={slots}, prompt {prompt_len}, new {new_tokens}, cache capacity {capacity}"
        "\n| decode attends over | tokens/s | vs whole cache |\n| --- | --- | --- |"
        f"\n| decode_window() (live length) | {window_tps:.0f} | {window_tps / full_tps:.2f}x |"
        f"\n| the whole cache | {full_tps:.0f} | 1.00x |"
    )

    print(
        "\n| checkpoint | MB | orbax load s | swap s | load MB/s |\n| --- | --- | --- | --- | --- |"
    )
    widths = [64] if args.quick else [64, 256, 512]
    for d in widths:
        scaled = cfg.replace(d_model=d, expert_dim=d // 2, dense_dim=2 * d)
        nbytes, load_s, swap_s = bench_swap(scaled, repeats)
        print(
            f"| tiny d_model={d} | {nbytes / 1e6:.1f} | {load_s:.3f} | {swap_s:.4f} | "
            f"{nbytes / 1e6 / load_s:.0f} |"
        )

    groups = 2 if args.quick else 16
    mbps, mb, routing_bytes = bench_pull(groups, 8, 128, 256 if args.quick else 1024, repeats)
    print("\n| Pull response | MB | MB/s | routing bytes/token |\n| --- | --- | --- | --- |")
    print(
        f"| {groups} groups x 8, Qwen3-30B-A3B routing | {mb:.1f} | {mbps:.0f} | {routing_bytes} |"
    )


if __name__ == "__main__":
    main()
