"""Multi-turn episodes in the rollout server: engine tokens/s against single-turn samples, and the
prefill work per turn of the incremental KV-cache extension against a full re-prefill.

    python benchmarks/multiturn.py [--preset small] [--turns 4] [--turn-tokens 32] [--json FILE]
    python benchmarks/multiturn.py --quick     # the tiny preset, 3 turns of 8 tokens (seconds)

One CPU device; the model is ``--preset`` with its vocabulary sized to a byte-level BPE tokenizer
made on the fly (``sat_jax.model.make_tiny.train_tokenizer``: the tiny checkpoint's tokenizer with
its Qwen-style chat template, written to a temporary directory and read by ``HFTokenizer``).
Random weights.

Throughput: the server's real pieces in process, as tests/rollout_server/test_episodes.py runs
them: one ``MoEEngine`` (``--slots`` slots) under a ``RolloutDriver`` fed by a ``RolloutLoop``
with ``--groups`` groups of ``--group-size`` samples of one fixed prompt in flight (admission
allows exactly those: ``batch_groups = groups``, ``max_staleness = 0``). The multi-turn variant
runs episodes of a scripted environment defined here (``FixedTurns``: after every turn the same
user message, ``RETRY_MESSAGE``, until ``max_turns``), so every episode has exactly ``--turns``
turns; the single-turn variant (``episodes=None``) generates ``turns · turn_tokens`` tokens per
sample, so both generate the same number of tokens with the same slots, engine and compiled
programs. Turn lengths are fixed by a stop-free sampler: the tokenizer's stop ids are its
``unsampleable_ids`` (so ``sampleable_mask`` removes them and the engine never samples them), and
every turn ends at ``--turn-tokens`` (``rollout.max_new_tokens``); a cut turn is then closed by the
template's end-of-turn tokens before the observation (one more inserted token than after a
sampled stop). Generated tokens are the trajectories' loss-mask-1 tokens; inserted ones are the
observations (loss mask 0). Wall time runs from the loop's start to its last group in the queue
(prefills, decode steps, the environment between turns, the extensions, and the slot steps
wasted while a turn waits for its environment). Medians over ``--repeats`` after one warm-up
round (which compiles), the variants interleaved.

Prefill per turn: from the multi-turn episodes' trajectories, what the engine computes before each
turn (turn 1: the prompt; turn t > 1: only the observation tokens, ``DecodeCore.extend``; the
engine's ``extend_tokens`` counter is checked against the trajectories' inserted tokens) against
what re-prefilling the whole conversation at each turn would compute (prompt + every earlier turn
and observation). Then the time of each on a separate ``DecodeCore`` of the engine's shapes (so
the extension attends over the same cache row): one ``extend`` of the observation at the point the
episode reached, against one ``prefill`` (the jitted function ``prefill_prompt`` runs) of the
whole conversation so far padded to a power of two of at least 16 (``prefill_prompt`` itself pads
to ``max_prefill_length``, which a re-prefill of a long conversation would have to raise); at
turn 1 both are the prompt's prefill. Medians over ``--repeats`` after a warm-up, interleaved.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# Run by path from a checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from rollout_api import records
from rollout_server.driver import RolloutDriver
from rollout_server.engine import MoEEngine
from rollout_server.persistence import StateStore
from rollout_server.rollout import RolloutLoop
from sat_jax.config import RolloutConfig, ServerConfig
from sat_jax.decoding import DecodeCore, SamplingConfig
from sat_jax.model import ModelConfig, Transformer
from sat_jax.model.make_tiny import train_tokenizer
from sat_jax.tasks import Prompt
from sat_jax.tasks.envs import RETRY_MESSAGE, EnvConfig, Environment, EpisodeRunner, Step
from sat_jax.tasks.hf_tokenizer import HFTokenizer


def prompts(n: int) -> list[Prompt]:
    """``n`` prompts of one template (a distinct prompt per group, so no group reuses the previous
    group's prefill: ``DecodeCore.prefill_once`` keeps the last one)."""
    text = "Tom has {a} apples and buys {b} more. How many apples does he have?"
    return [
        Prompt(id=f"p{i}", text=text.format(a=11 + i, b=7), answer=str(18 + i)) for i in range(n)
    ]


VARIANTS = ("single-turn", "multi-turn")


class FixedTurns(Environment):
    """Answers every turn with the same user message; `Episode` ends it at `max_turns`."""

    def step(self, text: str) -> Step:
        return Step(observations=[{"role": "user", "content": RETRY_MESSAGE}])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="groups in flight (and per round)")
    p.add_argument("--turns", type=int, default=4, help="turns of every episode")
    p.add_argument("--turn-tokens", type=int, default=32, help="generated tokens per turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny preset, 2 slots, 2 groups of 2, 3 turns of 8, 2 repeats",
    )
    p.add_argument("--json", default="", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.turns, args.turn_tokens, args.repeats = "tiny", 3, 8, 2
        args.slots, args.group_size, args.groups = 2, 2, 2
    return args


def make_tokenizer(directory: pathlib.Path) -> HFTokenizer:
    """The tiny checkpoint's BPE tokenizer with its chat template, made in ``directory``, whose
    stop ids are never sampled (see the module docstring)."""
    train_tokenizer(directory)
    tok = HFTokenizer(str(directory), chat_template=True)
    tok.unsampleable_ids = tuple(sorted(tok.stop_ids))
    return tok


class Bench:
    """One engine and driver for both variants, and the loops that run rounds on them."""

    def __init__(self, args: argparse.Namespace, tokenizer: HFTokenizer, tmp: pathlib.Path):
        self.args, self.tokenizer, self.tmp = args, tokenizer, tmp
        self.prompts = prompts(max(2, args.groups))
        opening = [
            tokenizer.encode_messages([{"role": "user", "content": p.text}]) for p in self.prompts
        ]
        if [tokenizer.encode_prompt(p.text) for p in self.prompts] != opening:
            raise AssertionError("the single-turn prompt must be the episode's opening")
        self.prompt_tokens = max(len(ids) for ids in opening)
        obs = tokenizer.observation_ids(
            [{"role": "user", "content": RETRY_MESSAGE}], close_turn=True
        )
        n, t = args.turns, args.turn_tokens
        # The episode's completion: every turn and the observations between them, plus the one
        # token of room the runner asks for after the last observation.
        self.episode_tokens = n * t + (n - 1) * len(obs) + 1
        self.max_prefill = max(16, 1 << (self.prompt_tokens - 1).bit_length())
        cache = self.max_prefill + self.episode_tokens + 1
        vocab = -(-len(tokenizer) // 64) * 64
        self.cfg = ModelConfig.preset(args.preset).replace(vocab_size=vocab, max_seq_len=cache)
        model = Transformer(self.cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
        self.engine = MoEEngine(
            model,
            tokenizer=tokenizer,
            slots=args.slots,
            max_prefill_length=self.max_prefill,
            max_decode_length=self.episode_tokens,
            sampling=SamplingConfig(),
        )
        params = self.engine.load_params()
        self.driver = RolloutDriver(
            prefill_engines=[self.engine],
            generate_engines=[self.engine],
            prefill_params=[params],
            generate_params=[params],
            interleaved_mode=True,
            jax_padding=False,
        )
        self.env_cfg = EnvConfig(
            reward="exact_match",
            system_prompt="",
            max_turns=n,
            max_episode_tokens=self.episode_tokens,
            turn_discount=1.0,
        )
        self.rounds = 0
        # Decode steps, counted around the engine's generate (JetStream's generate thread calls
        # it once per step; nothing else changes, the step is not waited for).
        self.steps = 0
        generate = self.engine.generate

        def counted(*args, **kwargs):
            self.steps += 1
            return generate(*args, **kwargs)

        self.engine.generate = counted

    def stop(self) -> None:
        """Stops the driver's threads."""
        self.driver.stop()

    def run_round(self, variant: str) -> dict[str, Any]:
        """One round of ``groups`` groups of one variant: wall seconds, token counts and the
        trajectories."""
        a = self.args
        multi = variant == "multi-turn"
        self.rounds += 1
        e = self.engine
        before = (
            e.prefill_tokens,
            e.extend_tokens,
            e.core.extend_calls,
            e.prefill_calls,
            self.steps,
        )
        loop = RolloutLoop(
            driver=self.driver,
            engine=e,
            prompts=grain.MapDataset.source(self.prompts).repeat().to_iter_dataset(),
            reward_fn=lambda text, answer: 0.0,
            tokenizer=self.tokenizer,
            cfg=RolloutConfig(
                group_size=a.group_size,
                max_new_tokens=a.turn_tokens if multi else a.turns * a.turn_tokens,
                batch_groups=a.groups,
                max_staleness=0,
            ),
            store=StateStore(str(self.tmp / f"state-{self.rounds}")),
            wait_for_weights=False,
            max_response_bytes=ServerConfig().max_message_bytes,
            lease_s=600.0,
            episodes=EpisodeRunner(FixedTurns, self.env_cfg, self.tokenizer) if multi else None,
        )
        start = time.perf_counter()
        loop.start()
        try:
            deadline = time.monotonic() + 1800
            while len(loop.queue) < a.groups:
                if time.monotonic() > deadline or not loop.alive():
                    raise RuntimeError(f"{variant}: {len(loop.queue)} of {a.groups} groups")
                time.sleep(0.005)
            wall = time.perf_counter() - start
        finally:
            loop.stop()
        trajectories = [
            t
            for m in loop.queue.snapshot()[: a.groups]
            for t in records.decode_group(m).trajectories
        ]
        masks = [_mask(t) for t in trajectories]
        after = (
            e.prefill_tokens,
            e.extend_tokens,
            e.core.extend_calls,
            e.prefill_calls,
            self.steps,
        )
        d = [x - y for x, y in zip(after, before, strict=True)]
        return {
            "wall_s": wall,
            "generated": int(sum(m.sum() for m in masks)),
            "inserted": int(sum((~m).sum() for m in masks)),
            "engine_prefill_tokens": d[0],
            "engine_extend_tokens": d[1],
            "engine_extend_calls": d[2],
            "engine_prefill_calls": d[3],
            "decode_steps": d[4],
            "trajectories": trajectories,
        }


def _mask(t: records.Trajectory) -> np.ndarray:
    """The trajectory's loss mask (all generated for a single-turn sample)."""
    if t.loss_mask is None:
        return np.ones(t.completion_ids.shape, bool)
    return np.asarray(t.loss_mask, bool)


def bench_throughput(bench: Bench) -> tuple[list[dict], list[records.Trajectory]]:
    """Per variant: medians of wall time and tokens/s, and the token counts of a round; also the
    last multi-turn round's trajectories."""
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(bench.args.repeats + 1):  # round 0 compiles: not counted
        order = VARIANTS[rep % 2 :] + VARIANTS[: rep % 2]
        for variant in order:
            result = bench.run_round(variant)
            print(f"  round {rep} {variant}: {result['wall_s']:.2f} s", flush=True)
            if rep:
                samples[variant].append(result)
    rows = []
    for variant in VARIANTS:
        runs = samples[variant]
        last = runs[-1]
        walls = [r["wall_s"] for r in runs]
        rates = [r["generated"] / r["wall_s"] for r in runs]
        rows.append(
            {
                "variant": variant,
                "samples": len(last["trajectories"]),
                "turns": bench.args.turns if variant == "multi-turn" else 1,
                "generated_tokens": last["generated"],
                "inserted_tokens": last["inserted"],
                "engine_prefill_tokens": last["engine_prefill_tokens"],
                "engine_prefill_calls": last["engine_prefill_calls"],
                "engine_extend_tokens": last["engine_extend_tokens"],
                "engine_extend_calls": last["engine_extend_calls"],
                "decode_steps": statistics.median(r["decode_steps"] for r in runs),
                "wall_s": statistics.median(walls),
                "tokens_per_s": statistics.median(rates),
                "wall_s_all": walls,
            }
        )
    return rows, samples["multi-turn"][-1]["trajectories"]


def turn_spans(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """Per turn of a multi-turn completion: (where its generated tokens start, how many, how
    many observation tokens follow it), from the loss mask's runs."""
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(mask)]
    runs = [
        (bounds[i], bounds[i + 1] - bounds[i], bool(mask[bounds[i]]))
        for i in range(len(bounds) - 1)
    ]
    spans = []
    for i, (start, n, generated) in enumerate(runs):
        if generated:
            follows = runs[i + 1][1] if i + 1 < len(runs) else 0
            spans.append((start, n, follows))
    return spans


def prefill_counts(trajectories: list[records.Trajectory], turns: int) -> list[dict]:
    """Per turn, tokens computed before it, summed over the episodes: incremental (the prompt,
    then each observation) against a full re-prefill of the conversation so far."""
    incremental, full = np.zeros(turns, np.int64), np.zeros(turns, np.int64)
    for t in trajectories:
        spans = turn_spans(_mask(t))
        if len(spans) != turns:
            raise AssertionError(f"an episode has {len(spans)} turns, expected {turns}")
        p = len(t.prompt_ids)
        for k, (start, _, _) in enumerate(spans):
            incremental[k] += p if k == 0 else spans[k - 1][2]
            full[k] += p + start
    n = len(trajectories)
    return [
        {
            "turn": k + 1,
            "incremental_tokens": float(incremental[k] / n),
            "full_tokens": float(full[k] / n),
        }
        for k in range(turns)
    ]


def bench_prefill_time(bench: Bench, trajectory: records.Trajectory, rows: list[dict]) -> None:
    """Adds to ``rows`` the median seconds of each turn's extension and of a full re-prefill of
    the conversation at that turn, measured on one episode (see the module docstring)."""
    e = bench.engine
    core = DecodeCore(
        e.core.graphdef,
        e.config,
        slots=e.core.slots,
        max_prefill_length=e.core.max_prefill_length,
        max_decode_length=e.core.max_decode_length,
        sampling=e.sampling,
        sampleable_v=e.sampleable_ids,
    )
    params = e.current_params()[1]
    prompt = [int(i) for i in trajectory.prompt_ids]
    completion = [int(i) for i in trajectory.completion_ids]
    spans = turn_spans(_mask(trajectory))
    p = len(prompt)
    state = core.insert(core.prefill_prompt(params, prompt), core.init_state(), 0)

    def full(k: int) -> Callable[[], Any]:
        ids = prompt + completion[: spans[k][0]]
        bucket = max(16, 1 << (len(ids) - 1).bit_length())
        tokens = np.zeros((bucket,), np.int32)
        tokens[: len(ids)] = ids
        args = (params, jnp.asarray(tokens), jnp.int32(len(ids)), jnp.int32(0))
        return lambda: jax.block_until_ready(core.prefill(*args))

    timings: dict[tuple[str, int], list[float]] = {}
    for k in range(len(spans)):
        run_full, run_extend = full(k), None  # turn 1: the prompt's prefill either way
        if k:
            before = spans[k][0] - spans[k - 1][2]  # the completion before the observation
            state, _ = core.extend(
                params,
                state,
                0,
                completion[:before],
                start=p,
                generated=before,
                version=0,
                segment=0,
            )
            obs = completion[before : spans[k][0]]

            def run_extend(obs=obs, before=before):
                nonlocal state
                state, _ = core.extend(
                    params,
                    state,
                    0,
                    obs,
                    start=p + before,
                    generated=before + len(obs),
                    version=0,
                    segment=0,
                )
                jax.block_until_ready(state)

        for rep in range(bench.args.repeats + 1):  # the first call compiles
            variants = [("full", run_full)] + ([("extend", run_extend)] if k else [])
            for name, fn in variants[:: 1 - 2 * (rep % 2)]:
                start = time.perf_counter()
                fn()
                if rep:
                    timings.setdefault((name, k), []).append(time.perf_counter() - start)
    for k, row in enumerate(rows):
        row["incremental_s"] = statistics.median(timings[("extend" if k else "full", k)])
        row["full_s"] = statistics.median(timings[("full", k)])


def format_tables(args: argparse.Namespace, throughput: list[dict], prefill: list[dict]) -> str:
    lines = [
        f"Engine throughput ({args.preset}, {args.slots} slots, {args.groups} groups x "
        f"{args.group_size} samples, {args.turns} turns x {args.turn_tokens} tokens or one turn "
        f"of {args.turns * args.turn_tokens}; medians of {args.repeats}):",
        "",
        "| variant | samples | turns | generated | inserted | prefill tokens | extend tokens | "
        "decode steps | wall s | generated tokens/s | vs single-turn |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = throughput[0]["tokens_per_s"]
    for r in throughput:
        lines.append(
            f"| {r['variant']} | {r['samples']} | {r['turns']} | {r['generated_tokens']:,} | "
            f"{r['inserted_tokens']:,} | {r['engine_prefill_tokens']:,} | "
            f"{r['engine_extend_tokens']:,} | {r['decode_steps']:,.0f} | {r['wall_s']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base:.2f}x |"
        )
    lines += [
        "",
        f"Prefill before each turn, per episode ({args.preset}; medians of {args.repeats}):",
        "",
        "| turn | incremental tokens | full re-prefill tokens | incremental ms | "
        "full re-prefill ms | full / incremental time |",
        "|---|---|---|---|---|---|",
    ]
    for r in prefill:
        lines.append(
            f"| {r['turn']} | {r['incremental_tokens']:.0f} | {r['full_tokens']:.0f} | "
            f"{1e3 * r['incremental_s']:.1f} | {1e3 * r['full_s']:.1f} | "
            f"{r['full_s'] / r['incremental_s']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sat_multiturn_bench_"))
    try:
        (tmp / "tok").mkdir()
        bench = Bench(args, make_tokenizer(tmp / "tok"), tmp)
        try:
            throughput, trajectories = bench_throughput(bench)
        finally:
            bench.stop()
        prefill = prefill_counts(trajectories, args.turns)
        bench_prefill_time(bench, trajectories[0], prefill)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "config": {
            "preset": args.preset,
            "slots": args.slots,
            "group_size": args.group_size,
            "groups": args.groups,
            "turns": args.turns,
            "turn_tokens": args.turn_tokens,
            "repeats": args.repeats,
            "prompt_tokens": bench.prompt_tokens,
            "max_decode_length": bench.episode_tokens,
        },
        "throughput": throughput,
        "prefill": prefill,
    }
    print(format_tables(args, throughput, prefill), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
