"""HTTP sessions against in-server episodes: the same multi-turn episodes played by external agents
through sat-serve's OpenAI endpoint (docs/DESIGN.md §6.6) and by the server's own EpisodeRunner,
at equal slots; engine tokens/s of each and the time the HTTP path adds per turn.

    python benchmarks/http_sessions.py [--preset small] [--turns 4] [--turn-tokens 32] [--json FILE]
    python benchmarks/http_sessions.py --quick     # the tiny preset, 3 turns of 8 tokens (seconds)
    python benchmarks/http_sessions.py --stream    # streamed replies: also time to first content
    python benchmarks/http_sessions.py --primitives [--preset small] [--history 512]
        # the engine's cost of a fork against a delta's extension, and of a constrained token

The setup is benchmarks/multiturn.py's (its ``Bench``): one CPU device, the ``--preset`` model
with random weights and its vocabulary sized to a byte-level BPE tokenizer with a Qwen-style chat
template made on the fly (no download), one ``MoEEngine`` of ``--slots`` slots under a
``RolloutDriver`` fed by a ``RolloutLoop`` that admits exactly ``--groups`` groups of
``--group-size`` samples (``batch_groups = groups``, ``max_staleness = 0``). Stop ids are never
sampled, so every turn is exactly ``--turn-tokens`` tokens and every episode exactly ``--turns``
turns; after every turn the user says ``RETRY_MESSAGE``. Both modes run the same episodes (same
prompts, turns, tokens per turn, slots, engine and compiled programs):

* ``in-server``: the loop's ``EpisodeRunner`` plays them (multiturn.py's ``FixedTurns``).
* ``http``: the loop offers every sample as a session (``SessionManager``), ``HttpApi`` serves it
  on a loopback port from its own asyncio thread, and ``--slots`` client threads (in this
  process), each with the official ``openai`` client, take one session at a time
  (``POST /sessions``), send ``--turns`` chat requests with ``max_tokens = turn_tokens`` (the
  conversation so far plus the user's message after each reply; the server extends the cache by
  the template's delta, the same ids the runner inserts) and end it (``POST /sessions/{id}/end``).

Engine tokens/s: generated tokens (loss mask 1 on the wire) over the wall time from the loop's
start to its last group in the queue, medians over ``--repeats`` rounds after one warm-up round
(which compiles), the modes interleaved.

Time added per turn by the HTTP path, two figures:

* ``overhead``, per turn of every session: the client-observed latency of its chat request (around
  ``chat.completions.create``) minus the engine's time for that turn, which is the time from the
  server handing the turn to the driver (``place_request_on_prefill_queue`` for turn 1,
  ``continue_episode`` after) to the driver reporting its end (``on_turn``, on the detokenize
  thread). What remains is the HTTP path's own work: the client building and parsing JSON, the
  aiohttp request, checking the body, rendering the template's delta, the hops between the
  driver's thread and the asyncio loop, and building the reply. Mean and median over all turns.
  The in-server runner's engine time per turn is measured the same way (``engine_turn_ms``).
* ``wall_added_per_turn``: the rounds' wall-time difference spread over the turns one slot plays,
  ``(wall_http - wall_in_server) * slots / (samples * turns)``; it also counts what the HTTP path
  delays that the overhead does not see (a slot idle while its agent's request is in flight).

The client threads share the process (and its GIL) with the engine's threads, as agents on the
server's host would not: on a small machine the HTTP figures are an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

# Run by path from a checkout, installed or not; multiturn.py is this benchmark's sibling.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import grain
import numpy as np
import openai

# isort: split
import multiturn  # benchmarks/multiturn.py

# isort: split
from rollout_api import records
from rollout_server.http_api import HttpApi, HttpLimits
from rollout_server.persistence import StateStore
from rollout_server.rollout import RolloutLoop
from rollout_server.sessions import Generator, SessionLimits, SessionManager
from sat_jax.config import RolloutConfig, ServerConfig
from sat_jax.tasks.envs import RETRY_MESSAGE, EpisodeRunner

MODES = ("in-server", "http")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--slots", type=int, default=4, help="engine slots and client threads")
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
    p.add_argument(
        "--stream",
        action="store_true",
        help="the agents stream their replies; also time each turn's first content chunk",
    )
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument(
        "--primitives",
        action="store_true",
        help="time the engine's primitives instead: a fork's re-prefill against a delta's "
        "cache extension, and a decode step with a constrained slot against a free one",
    )
    p.add_argument("--history", type=int, default=512, help="--primitives: history tokens")
    p.add_argument("--delta", type=int, default=32, help="--primitives: a delta's tokens")
    p.add_argument("--steps", type=int, default=64, help="--primitives: decode steps per round")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.turns, args.turn_tokens, args.repeats = "tiny", 3, 8, 2
        args.slots, args.group_size, args.groups = 2, 2, 2
    return args


class TakenSessions(SessionManager):
    """A `SessionManager` that remembers the sessions taken (their engine requests carry the
    turn times)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.taken: dict[str, Any] = {}

    async def take(self, max_sessions: int, timeout_s: float) -> list:
        taken = await super().take(max_sessions, timeout_s)
        self.taken.update({s.id: s for s in taken})
        return taken


def time_turns(driver) -> None:
    """Stamps every episode request's turns: (handed to the driver, ended) on the request's
    ``bench_turns`` (module docstring)."""
    place, cont = driver.place_request_on_prefill_queue, driver.continue_episode

    def placed(request):
        if request.episode and request.on_turn is not None:
            request.bench_turns = [[time.perf_counter(), None]]
            on_turn = request.on_turn

            def ended(req, turn):
                req.bench_turns[-1][1] = time.perf_counter()
                on_turn(req, turn)

            request.on_turn = ended
        return place(request)

    def continued(request, tokens):
        request.bench_turns.append([time.perf_counter(), None])
        return cont(request, tokens)

    driver.place_request_on_prefill_queue = placed
    driver.continue_episode = continued


def engine_turn_s(request) -> list[float]:
    return [end - start for start, end in request.bench_turns if end is not None]


class HttpBench(multiturn.Bench):
    """multiturn.py's engine and driver, with rounds of either mode."""

    def __init__(self, args: argparse.Namespace, tokenizer, tmp: pathlib.Path):
        super().__init__(args, tokenizer, tmp)
        time_turns(self.driver)
        self.aio = asyncio.new_event_loop()
        self.aio_thread = threading.Thread(target=self.aio.run_forever, daemon=True)
        self.aio_thread.start()

    def stop(self) -> None:
        self.aio.call_soon_threadsafe(self.aio.stop)
        self.aio_thread.join(10)
        super().stop()

    def _loop(self, **kwargs) -> RolloutLoop:
        a = self.args
        self.rounds += 1
        return RolloutLoop(
            driver=self.driver,
            engine=self.engine,
            prompts=grain.MapDataset.source(self.prompts).repeat().to_iter_dataset(),
            reward_fn=lambda text, answer: 0.0,
            tokenizer=self.tokenizer,
            cfg=RolloutConfig(
                group_size=a.group_size,
                max_new_tokens=a.turn_tokens,
                batch_groups=a.groups,
                max_staleness=0,
            ),
            store=StateStore(str(self.tmp / f"state-{self.rounds}")),
            wait_for_weights=False,
            max_response_bytes=ServerConfig().max_message_bytes,
            lease_s=600.0,
            **kwargs,
        )

    def _wait_groups(self, loop: RolloutLoop, mode: str) -> float:
        start = time.perf_counter()
        loop.start()
        deadline = time.monotonic() + 1800
        while len(loop.queue) < self.args.groups:
            if time.monotonic() > deadline or not loop.alive():
                raise RuntimeError(f"{mode}: {len(loop.queue)} of {self.args.groups} groups")
            time.sleep(0.005)
        return time.perf_counter() - start

    def run_round(self, mode: str) -> dict[str, Any]:
        """One round of ``groups`` groups in ``mode``: wall seconds, generated tokens and the
        per-turn times."""
        if mode == "in-server":
            runner = EpisodeRunner(multiturn.FixedTurns, self.env_cfg, self.tokenizer)
            requests: list = []
            loop = self._loop(episodes=runner)
            place = self.driver.place_request_on_prefill_queue

            def keep(request):  # the round's requests, for their turn times
                requests.append(request)
                return place(request)

            self.driver.place_request_on_prefill_queue = keep
            try:
                wall = self._wait_groups(loop, mode)
            finally:
                self.driver.place_request_on_prefill_queue = place
                loop.stop()
            engine = [t for r in requests if r.episode for t in engine_turn_s(r)]
            latency: list[float] = []
            first: list[float] = []
        else:
            wall, loop, engine, latency, first = self._http_round()
        trajectories = [
            t
            for m in loop.queue.snapshot()[: self.args.groups]
            for t in records.decode_group(m).trajectories
        ]
        generated = sum(int(multiturn._mask(t).sum()) for t in trajectories)
        return {
            "wall_s": wall,
            "generated": generated,
            "samples": len(trajectories),
            "engine_turn_s": engine,
            "latency_s": latency,
            "first_s": first,
        }

    def _http_round(self) -> tuple[float, RolloutLoop, list[float], list[float], list[float]]:
        a = self.args
        samples = a.groups * a.group_size
        sessions = TakenSessions(
            Generator(self.driver, self.engine, self.tokenizer),
            lambda text, answer: 0.0,
            SessionLimits(max_sessions=samples, idle_s=600.0),
        )
        api = HttpApi(
            generator=sessions.gen,
            sessions=sessions,
            limits=HttpLimits(max_body_bytes=1 << 20, max_messages=64, max_requests=8),
            token="",
            model_name="bench",
            default_tokens=a.turn_tokens,
        )
        port = asyncio.run_coroutine_threadsafe(api.start("127.0.0.1", 0), self.aio).result(60)
        url = f"http://127.0.0.1:{port}"
        stop = threading.Event()
        latency: dict[str, list[float]] = {}
        first: dict[str, list[float]] = {}
        errors: list[BaseException] = []
        clients = [
            threading.Thread(
                target=_agent, args=(url, a, stop, latency, first, errors), daemon=True
            )
            for _ in range(a.slots)
        ]
        loop = self._loop(sessions=sessions)
        for c in clients:
            c.start()
        try:
            wall = self._wait_groups(loop, "http")
        finally:
            stop.set()
            for c in clients:
                c.join(60)
            loop.stop()
            asyncio.run_coroutine_threadsafe(api.stop(), self.aio).result(30)
        if errors:
            raise RuntimeError(f"an agent failed: {errors[0]!r}") from errors[0]
        engine, client = [], []
        for sid, lat in latency.items():
            turns = engine_turn_s(sessions.taken[sid].request)
            if len(turns) != len(lat):
                raise AssertionError(f"{len(lat)} requests but {len(turns)} engine turns")
            engine += turns
            client += lat
        return wall, loop, engine, client, [t for ts in first.values() for t in ts]


def _agent(url, args, stop, latency, first, errors) -> None:
    """One client thread: takes sessions one at a time and plays ``--turns`` turns of each
    (streamed with ``--stream``: then ``first`` gets each turn's time to its first content)."""
    server = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    try:
        while not stop.is_set():
            taken = server.post(
                "/sessions", body={"max_sessions": 1, "timeout_s": 0.2}, cast_to=object
            )
            for session in taken["sessions"]:
                sid = session["session_id"]
                client = server.with_options(base_url=f"{url}/sessions/{sid}/v1")
                messages = [{"role": "user", "content": session["prompt"]["text"]}]
                times = latency.setdefault(sid, [])
                firsts = first.setdefault(sid, [])
                for turn in range(args.turns):
                    if turn:
                        messages.append({"role": "user", "content": RETRY_MESSAGE})
                    start = time.perf_counter()
                    if args.stream:
                        content, seen = "", None
                        for chunk in client.chat.completions.create(
                            model="bench",
                            messages=messages,
                            max_tokens=args.turn_tokens,
                            stream=True,
                        ):
                            delta = chunk.choices[0].delta.content if chunk.choices else None
                            if delta and seen is None:
                                seen = time.perf_counter() - start
                            content += delta or ""
                        times.append(time.perf_counter() - start)
                        firsts.append(seen if seen is not None else times[-1])
                        messages.append({"role": "assistant", "content": content})
                        continue
                    reply = client.chat.completions.create(
                        model="bench", messages=messages, max_tokens=args.turn_tokens
                    )
                    times.append(time.perf_counter() - start)
                    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                server.post(f"/sessions/{sid}/end", body={"reward": 0.0}, cast_to=object)
    except BaseException as e:  # reported by the round
        errors.append(e)


def bench(b: HttpBench) -> dict[str, Any]:
    """Per mode: medians of wall time and tokens/s; the per-turn figures (module docstring)."""
    a = b.args
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(a.repeats + 1):  # round 0 compiles: not counted
        for mode in MODES[rep % 2 :] + MODES[: rep % 2]:
            result = b.run_round(mode)
            print(f"  round {rep} {mode}: {result['wall_s']:.2f} s", flush=True)
            if rep:
                runs[mode].append(result)
    modes = {}
    for mode in MODES:
        r = runs[mode]
        engine = [t for x in r for t in x["engine_turn_s"]]
        modes[mode] = {
            "samples": r[-1]["samples"],
            "generated_tokens": r[-1]["generated"],
            "wall_s": statistics.median(x["wall_s"] for x in r),
            "tokens_per_s": statistics.median(x["generated"] / x["wall_s"] for x in r),
            "wall_s_all": [x["wall_s"] for x in r],
            "engine_turn_ms": _stats(engine),
        }
    http = runs["http"]
    overhead = [
        lat - eng for x in http for lat, eng in zip(x["latency_s"], x["engine_turn_s"], strict=True)
    ]
    modes["http"]["client_turn_ms"] = _stats([t for x in http for t in x["latency_s"]])
    if a.stream:
        modes["http"]["first_content_ms"] = _stats([t for x in http for t in x["first_s"]])
    samples = a.groups * a.group_size
    added = modes["http"]["wall_s"] - modes["in-server"]["wall_s"]
    return {
        "modes": modes,
        "ratio": modes["http"]["tokens_per_s"] / modes["in-server"]["tokens_per_s"],
        "overhead_ms": _stats(overhead),
        "wall_added_per_turn_ms": 1e3 * added * a.slots / (samples * a.turns),
    }


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = 1e3 * np.asarray(seconds, np.float64)
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "n": int(ms.size)}


def format_table(args: argparse.Namespace, r: dict[str, Any]) -> str:
    lines = [
        f"HTTP sessions against in-server episodes ({args.preset}, {args.slots} slots and "
        f"{args.slots} clients, {args.groups} groups x {args.group_size} samples, {args.turns} "
        f"turns x {args.turn_tokens} tokens; medians of {args.repeats}):",
        "",
        "| mode | samples | generated | wall s | engine tokens/s | vs in-server | "
        "engine ms/turn (mean / median) | client ms/turn (mean / median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = r["modes"]["in-server"]["tokens_per_s"]
    for mode in MODES:
        m = r["modes"][mode]
        e, c = m["engine_turn_ms"], m.get("client_turn_ms")
        client = f"{c['mean']:.1f} / {c['median']:.1f}" if c else "-"
        lines.append(
            f"| {mode} | {m['samples']} | {m['generated_tokens']:,} | {m['wall_s']:.2f} | "
            f"{m['tokens_per_s']:,.0f} | {m['tokens_per_s'] / base:.2f}x | "
            f"{e['mean']:.1f} / {e['median']:.1f} | {client} |"
        )
    o = r["overhead_ms"]
    lines += [
        "",
        f"Time added per turn by the HTTP path: client latency - engine turn time "
        f"{o['mean']:.1f} ms mean, {o['median']:.1f} ms median ({o['n']} turns); wall-time "
        f"difference per turn of a slot {r['wall_added_per_turn_ms']:.1f} ms.",
    ]
    if "first_content_ms" in r["modes"]["http"]:
        f = r["modes"]["http"]["first_content_ms"]
        lines.append(
            f"Streamed: time to the first content chunk {f['mean']:.1f} ms mean, "
            f"{f['median']:.1f} ms median ({f['n']} turns)."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.primitives:
        return primitives_main(args)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sat_http_sessions_bench_"))
    try:
        (tmp / "tok").mkdir()
        b = HttpBench(args, multiturn.make_tokenizer(tmp / "tok"), tmp)
        try:
            result = bench(b)
        finally:
            b.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "config": {
            "preset": args.preset,
            "slots": args.slots,
            "clients": args.slots,
            "group_size": args.group_size,
            "groups": args.groups,
            "turns": args.turns,
            "turn_tokens": args.turn_tokens,
            "repeats": args.repeats,
            "stream": args.stream,
        },
        **result,
    }
    print(format_table(args, result), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


# ---- --primitives: what a fork and a constrained token cost the engine -------------------------
#
# A fork (`server.http_session_fork`) releases the session's slot and prefills the whole new
# history into a slot (`DecodeCore.prefill_prompt` + `insert`); an agreeing request extends the
# slot's cache by the delta only (`DecodeCore.extend`). A constrained slot (`response_format`)
# makes every decode step wait for the previous step's tokens, build its [B, V] mask rows on the
# host (`SlotFormats`) and send them; a free engine dispatches steps back to back. Timed on the
# engine directly (no HTTP, no queueing), medians over --repeats rounds after a warm-up round.


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fork_cost(engine, params, history: int, delta: int, repeats: int) -> dict[str, float]:
    """Seconds of a fork's re-prefill + insert of `history + delta` tokens against the
    extension of a slot holding `history` tokens by `delta` tokens."""
    import jax

    core = engine.core
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 200, size=history + delta).astype(np.int32)
    state = core.init_state()
    state = core.insert(core.prefill_prompt(params, ids[:history].tolist()), state, 0)
    box = {"state": state, "n": 0}

    def extend():
        box["state"], routing = core.extend(
            params, box["state"], 0, ids[history:], start=history, generated=delta,
            version=0, segment=1,
        )  # fmt: skip
        jax.block_until_ready((box["state"], routing))

    def fork():
        box["n"] += 1  # a new history each time (a repeated one would reuse the last prefill)
        new = ids.copy()
        new[history - 1] = 3 + box["n"] % 190
        prefix = core.prefill_prompt(params, new.tolist())
        box["state"] = core.insert(prefix, core.evict(box["state"], 0), 0)
        jax.block_until_ready(box["state"])

    return {"extend_s": _timed(extend, repeats), "fork_s": _timed(fork, repeats)}


def constrained_cost(engine, tokenizer, params, steps: int, repeats: int) -> dict[str, float]:
    """Seconds per decode step of every slot free against one slot under json_object (its
    format set again whenever its value ends, so it is constrained at every step)."""
    import jax

    from sat_jax.json_mask import parse_response_format

    fmt = parse_response_format({"type": "json_object"})
    prompt = tokenizer.encode_messages([{"role": "user", "content": "Reply in JSON."}])
    box: dict[str, Any] = {}

    def fill(constrained: bool) -> None:
        state = engine.init_decode_state()
        for slot in range(engine.max_concurrent_decodes):
            prefix = engine.prefill(padded_tokens=np.asarray(prompt), true_length=len(prompt))
            state = engine.insert(prefix, state, slot)
        engine.formats.set(0, fmt if constrained else None, segment=0)
        box["state"] = state

    def run(constrained: bool) -> float:
        fill(constrained)
        jax.block_until_ready(box["state"])
        t0 = time.perf_counter()
        for _ in range(steps):
            if constrained and not engine.formats.active(0):
                engine.formats.set(0, fmt, segment=0)
            box["state"], result = engine.generate(params, box["state"])
        jax.block_until_ready(result.data)
        return (time.perf_counter() - t0) / steps

    run(False), run(True)  # warm-up: compiles, and fills the mask cache's states
    rounds = [(run(False), run(True)) for _ in range(repeats)]  # interleaved
    free = statistics.median(r[0] for r in rounds)
    masked = statistics.median(r[1] for r in rounds)
    return {"free_step_s": free, "constrained_step_s": masked}


def primitives_main(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    from flax import nnx

    from rollout_server.engine import MoEEngine
    from sat_jax.decoding import SamplingConfig
    from sat_jax.model import ModelConfig, Transformer

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sat_http_primitives_bench_"))
    try:
        (tmp / "tok").mkdir()
        tokenizer = multiturn.make_tokenizer(tmp / "tok")
        total = args.history + args.delta
        max_prefill = max(16, 1 << (total - 1).bit_length())
        vocab = -(-len(tokenizer) // 64) * 64
        cfg = ModelConfig.preset(args.preset).replace(
            vocab_size=vocab, max_seq_len=max_prefill + total + args.steps + 2
        )
        model = Transformer(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
        engine = MoEEngine(
            model, tokenizer=tokenizer, slots=args.slots, max_prefill_length=max_prefill,
            max_decode_length=total + args.steps + 1, sampling=SamplingConfig(),
        )  # fmt: skip
        params = engine.load_params()
        fork = fork_cost(engine, params, args.history, args.delta, args.repeats)
        mask = constrained_cost(engine, tokenizer, params, args.steps, args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "config": {
            "preset": args.preset, "slots": args.slots, "history": args.history,
            "delta": args.delta, "steps": args.steps, "repeats": args.repeats,
            "vocab": vocab,
        },
        **fork,
        **mask,
    }  # fmt: skip
    print(
        f"fork (re-prefill {total} + insert) {fork['fork_s'] * 1e3:.1f} ms vs extension by "
        f"{args.delta} after {args.history}: {fork['extend_s'] * 1e3:.1f} ms "
        f"({fork['fork_s'] / fork['extend_s']:.1f}x)\n"
        f"decode step, {args.slots} slots: all free {mask['free_step_s'] * 1e3:.2f} ms, one "
        f"under json_object {mask['constrained_step_s'] * 1e3:.2f} ms "
        f"({mask['constrained_step_s'] / mask['free_step_s']:.2f}x)",
        flush=True,
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
