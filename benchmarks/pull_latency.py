"""Pull latency on a rollout server under a burst of acknowledgements and finished groups.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/pull_latency.py [--seconds 20]
        [--clients 4] [--max-groups 4] [--queue-groups 128] [--dir DIR] [--json OUT]

The rollout loop (`rollout_server.rollout.RolloutLoop`) runs with an engine and a driver that
finish every sample at once, so what it does besides bookkeeping is persistence: each
acknowledgement frees admission, the loop dispatches a replacement (a state change), the
replacement finishes and is queued. The state lives in a real `state_dir` on disk (`--dir`, default
a temporary directory under /tmp): the JSON of ~queue_groups unacknowledged prompts, with its
fsyncs. `--clients` trainer-like threads each Pull up to `--max-groups` groups, acknowledging the
groups of their previous Pull with it (as the trainer does); one more thread Pulls one group
without acknowledgements and acknowledges it with `Ack` (timed apart). Admission is bounded by
the queue's capacity alone (`--queue-groups`, `max_staleness` unbounded): every acknowledged group
is replaced at once, so the queue stays full and no Pull waits for a group: its latency is the
loop's lock and the disk.

Printed (and written to `--json`): median and p99 latency in ms of Pulls carrying
acknowledgements, of Pulls without, and of Acks; Pulls per second; the groups dispatched and
acknowledged, and the state writes.
Runs against whichever `rollout_server` is on PYTHONPATH (the tree from before group commit too).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import numpy as np

from rollout_server.driver import FinishedSample
from rollout_server.persistence import StateStore
from rollout_server.rollout import RolloutLoop
from sat_jax.config import RolloutConfig, ServerConfig
from sat_jax.tasks import CharTokenizer, exact_match_reward, prompt_dataset
from sat_jax.tasks.config import TaskConfig

_WARMUP_S = 1.0


class InstantEngine:
    """The engine as the loop sees it: a version, and every prompt fits."""

    version = 0
    prefill_calls = prefill_tokens = extend_tokens = 0

    def swap_params(self, version, params):
        self.version = version

    def check_prompt_length(self, n):
        pass


class InstantDriver:
    """Finishes every request as it is placed (one short sample)."""

    tokens_generated = 0

    def place_request_on_prefill_queue(self, request):
        sample = FinishedSample(
            prompt_ids=np.array([1, 5, 6], np.int32),
            completion_ids=np.array([7, 2], np.int32),
            logprobs=np.zeros(2, np.float32),
            versions=np.zeros(2, np.int64),
            routing=np.zeros((5, 1, 2), np.uint8),
            finish_reason="stop",
        )
        request.on_done(request, sample)


class CountingStore(StateStore):
    """Counts the state writes (whatever calls `save`)."""

    saves = 0

    def save(self, state):
        super().save(state)
        self.saves += 1


def _client(loop, stop, out, *, max_groups: int, with_acks: bool) -> None:
    """Pulls until `stop`; appends (start time, seconds, kind) to `out`."""
    mine: list[int] = []
    while not stop.is_set():
        start = time.perf_counter()
        if with_acks:
            groups = loop.pull(max_groups, 5.0, ack=mine)
            out.append((start, time.perf_counter() - start, "pull_acks" if mine else "pull"))
        else:
            groups = loop.pull(max_groups, 5.0)
            out.append((start, time.perf_counter() - start, "pull"))
            if groups:
                start = time.perf_counter()
                loop.ack([g.group_id for g in groups])
                out.append((start, time.perf_counter() - start, "ack"))
        mine = [g.group_id for g in groups] if with_acks else []


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {
        "n": len(ms),
        "median_ms": float(np.median(ms)) if len(ms) else float("nan"),
        "p99_ms": float(np.percentile(ms, 99)) if len(ms) else float("nan"),
    }


def run(args: argparse.Namespace, directory: str) -> dict:
    cfg = RolloutConfig(
        batch_groups=args.queue_groups // 2,
        max_staleness=10**6,  # admission bounded by the queue's capacity alone
        group_size=args.group_size,
        queue_groups=args.queue_groups,
    )
    store = CountingStore(directory)
    loop = RolloutLoop(
        driver=InstantDriver(),
        engine=InstantEngine(),
        prompts=prompt_dataset(TaskConfig()),
        reward_fn=exact_match_reward,
        tokenizer=CharTokenizer("0123456789+-="),
        cfg=cfg,
        store=store,
        wait_for_weights=False,
        max_response_bytes=ServerConfig().max_message_bytes,
        lease_s=600.0,
    )
    loop.start()
    deadline = time.monotonic() + 120
    while len(loop.queue) < cfg.queue_groups // 2:  # a queue of finished groups to start with
        if time.monotonic() > deadline:
            raise RuntimeError(f"the loop queued {len(loop.queue)} groups in 120 s (see its log)")
        time.sleep(0.05)
    stop, out = threading.Event(), []
    threads = [
        threading.Thread(
            target=_client, args=(loop, stop, out), kwargs=dict(max_groups=args.max_groups,
                                                                with_acks=True)
        )
        for _ in range(args.clients)
    ]  # fmt: skip
    threads.append(
        threading.Thread(
            target=_client, args=(loop, stop, out), kwargs=dict(max_groups=1, with_acks=False)
        )
    )
    start = time.perf_counter()
    consumed0, dispatched0 = loop.persisted.consumed, loop.persisted.next_group_id
    saves0 = store.saves
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    loop.stop()
    store.close()
    kept = [(s, kind) for t0, s, kind in out if t0 - start >= _WARMUP_S]
    result = {
        kind: _summary([s for s, k in kept if k == kind]) for kind in ("pull_acks", "pull", "ack")
    }
    pulls = sum(1 for _, k in kept if k.startswith("pull"))
    result["pulls_per_s"] = pulls / (elapsed - _WARMUP_S)
    # Each dispatch and each acknowledging call is a state change (one write each, before).
    result["groups_dispatched"] = loop.persisted.next_group_id - dispatched0
    result["groups_acked"] = loop.persisted.consumed - consumed0
    result["acknowledging_calls"] = sum(1 for _, _, k in out if k in ("pull_acks", "ack"))
    result["writes"] = store.saves - saves0
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-groups", type=int, default=4)
    parser.add_argument("--queue-groups", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--dir", default="", help="the state_dir's parent (default: /tmp)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.seconds <= _WARMUP_S:
        parser.error(f"--seconds must be more than the {_WARMUP_S:g} s of warm-up left out")
    for name in ("clients", "max_groups", "group_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.queue_groups < 2:
        parser.error("--queue-groups must be >= 2")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as root:
        result = run(args, os.path.join(root, "state"))
    import rollout_server

    result.update(
        tree=os.path.dirname(os.path.dirname(os.path.abspath(rollout_server.__file__))),
        load_average=os.getloadavg(),
        args=vars(args),
    )
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
