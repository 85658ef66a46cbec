"""Two more live faults of the fleet (docs/DESIGN.md §6.3, §6.5), with the trainer's loop in this
process and rollout server processes, as in ``tests/train/test_fleet_live.py``:

- A server slowed by SIGSTOP/SIGCONT cycles: one of two servers is stopped at every few trainer
  steps and continued once the other has made everything its admission allows (so it is stopped
  mid-generation, mid-Pull or mid-push, for as long as the fleet can go on without it). The run
  finishes with every group trained exactly once, no trained token older than max_staleness,
  and no stale drop after the first steps.
- A run whose every step is skipped (``train.overlong=mask`` and a policy that never emits a stop
  id, so every completion is cut and nothing is active): each skipped step republishes the
  weights under the new version, so the server's admission stays open and the run goes on far
  past the (max_staleness + 1) batches that closed it before, instead of dying of
  ``train.client.wait_s``; also with ``rollout.logprob_replay=full``. With
  ``train.max_skipped_steps`` it stops after that many, checkpointed, naming the cause.

Nothing here waits on the wall clock for a result: steps are paced by events (``PacedStep``), the
stops by the trainer's steps and the other server's state; every timeout is only a hang guard.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading

import jax
import numpy as np
import pytest

from sat_jax.experiment import load_config, make_tokenizer
from tests.train.test_fleet_live import _jax_env, _overrides, _server, _server_id, _start, _train
from tests.train.test_main import CONFIG, PacedStep, _caught_up, _loop_parts, _push_to
from train import checkpointing, main, metrics, setup, skips, weight_sync

pytestmark = pytest.mark.slow
_ = _jax_env  # the autouse fixture, applied here too

B = 2  # groups per batch (test_fleet_live's)
S = 1  # rollout.max_staleness (test_fleet_live's)
WARMUP = 3  # steps while the servers compile their programs: stale drops are not counted there


def _swapped_versions(log_path) -> list[int]:
    """The weights versions a server's log says it installed, in order."""
    text = log_path.read_text()
    return [int(v) for v in re.findall(r"weights swapped: version \d+ -> (\d+)", text)]


class _StopCycler:
    """SIGSTOPs ``slow`` at the start of every ``every``-th trainer step (a ``PacedStep`` hook,
    so keyed on the trainer's progress) and SIGCONTs it from a thread once ``other`` has made
    every group its admission allows (``_caught_up``): ``slow`` is stopped for as long as the
    fleet can go on without it, whatever it was doing. ``close`` continues it for good."""

    def __init__(self, slow, other):
        self.slow, self.other = slow, other
        self.stops = 0
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def stop(self) -> None:
        if self.slow.proc.poll() is not None:
            return
        os.kill(self.slow.proc.pid, signal.SIGSTOP)
        self.stops += 1
        thread = threading.Thread(target=self._continue_when_other_caught_up, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _continue_when_other_caught_up(self) -> None:
        try:
            _caught_up([self.other])  # a hang guard of its own (300 s)
        except BaseException as e:  # reported by the test
            self.errors.append(e)
        finally:
            self._cont()

    def _cont(self) -> None:
        if self.slow.proc.poll() is None:
            os.kill(self.slow.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        for thread in self._threads:
            thread.join(timeout=330)
        self._cont()


def test_a_server_slowed_by_sigstop_cycles_wastes_nothing_and_loses_nothing(tmp_path):
    """b is stopped at steps 4, 7, 10, 13 and 16, each time until a has caught up. No failure
    makes b leave (grace 600 s): it stays in the fleet, slow. Bounds: exactly once, lag at most
    max_staleness on every trained token, stale drops at most 2% of the groups trained after the
    first steps, and b's groups trained after its first stop (it was slowed, not lost)."""
    steps, every, first = 18, 3, 4
    overrides = _overrides(tmp_path, "train.client.wait_s=300", "train.client.grace_s=600")
    a, b = _server(tmp_path, "a", overrides), _server(tmp_path, "b", overrides)
    cycler = _StopCycler(b, a)
    hooks = {k: cycler.stop for k in range(first, steps, every)}
    with a, b, metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=steps, console=None) as w:
        a.wait_ready(timeout_s=240)
        b.wait_ready(timeout_s=240)
        servers = f"train.client.servers=[{a.address},{b.address}]"
        cfg = load_config(CONFIG, [*overrides, servers, f"train.steps={steps}"])
        try:
            with setup.connect(cfg, None) as pool:
                state, progress = _start(cfg)
                state, progress = _train(cfg, pool, state, progress, w, PacedStep([a, b], hooks))
        finally:
            cycler.close()
        path = w.jsonl_path
        b_id = _server_id(tmp_path, "b")
    assert not cycler.errors, cycler.errors
    assert cycler.stops == len(hooks)
    records = metrics.read_jsonl(path)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # the run finished
    # Exactly once: every step trained B groups, none of them twice.
    keys = progress.recent_group_keys
    assert len(keys) == steps * B and len(set(keys)) == len(keys), keys
    # No trained token older than max_staleness.
    assert max(r["lag_max"] for r in records) <= S, [r["lag_max"] for r in records]
    # Waste: at most 2% of the groups trained after the warm-up went stale after it.
    late_drops = records[-1]["stale_dropped"] - records[WARMUP - 1]["stale_dropped"]
    late_trained = (steps - WARMUP) * B
    assert late_drops <= 0.02 * late_trained, [r["stale_dropped"] for r in records]
    # b was slowed, not lost: it stayed up and its groups were trained after its first stop.
    assert all(r["servers_up"] == 2 for r in records), [r["servers_up"] for r in records]
    assert any(k.startswith(f"{b_id}/") for k in keys[first * B :]), keys


class _SkipWhenNothingActive(PacedStep):
    """``PacedStep`` whose step is skipped, as ``train_step`` skips one, when the batch has no
    active token, until its ``last``-th call, which counts as an update whatever the batch:
    skipped steps do not count towards ``train.steps``, so a run whose every step is skipped
    goes on until stopped, and this ends a run of ``train.steps=1`` there."""

    def __init__(self, servers, last: int):
        super().__init__(servers)
        self.last = last
        self.active: list[float] = []

    def __call__(self, state, batch):
        state, _ = super().__call__(state, batch)  # paced; one update
        self.active.append(float(np.asarray(batch.loss_mask).sum()))
        skipped = self.calls < self.last and self.active[-1] == 0
        return state.replace(step=state.step - int(skipped)), {"step_skipped": np.bool_(skipped)}


def _never_stopping(params: dict, stop_ids) -> dict:
    """``params`` made to never sample a stop id: the embeddings' first coordinate is 5 for
    every token (so the final norm's input keeps it positive), the final norm keeps only that
    coordinate, and the output head gives it -50 towards every stop id and 0 towards the rest
    (every other id equally likely)."""
    embedding = np.array(params["embedding_vd"])
    embedding[:, 0] = 5.0
    scale = np.zeros_like(np.asarray(params["final_norm"]["scale"]))
    scale[0] = 1.0
    head = np.zeros_like(np.asarray(params["lm_head_dv"]))
    head[0, sorted(stop_ids)] = -50.0
    changed = {"embedding_vd": embedding, "final_norm": {"scale": scale}, "lm_head_dv": head}
    return {**params, **jax.tree.map(jax.device_put, changed)}


@pytest.mark.parametrize(
    "replay", [[], ["rollout.logprob_replay=full", "rollout.top_k=8"]], ids=["default", "full"]
)
def test_a_run_whose_every_step_is_skipped_goes_on(tmp_path, replay):
    """Every completion is cut (2 new tokens, no stop id ever sampled) and masked, so every step
    is skipped. Before, an async trainer pushed nothing on a skipped step: the server's weights
    stayed at version 1, its admission closed after (max_staleness + 1) batches and the run died
    of train.client.wait_s. Now every skipped step republishes, the server follows the trainer's
    version, and the run consumes 5 × (max_staleness + 1) batches, every one skipped but the
    last, which the test counts as the run's one update to end it."""
    consumed = 5 * (S + 1)
    overrides = _overrides(
        tmp_path,
        "train.client.wait_s=300",
        "train.overlong=mask",
        "rollout.max_new_tokens=2",
        *replay,
    )
    server = _server(tmp_path, "a", overrides)
    step = _SkipWhenNothingActive([server], last=consumed)
    with server, metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=1, console=None) as w:
        server.wait_ready(timeout_s=240)
        cfg = load_config(CONFIG, [*overrides, "train.steps=1"])
        state, progress = _start(cfg)
        state = state.replace(params=_never_stopping(state.params, make_tokenizer(cfg).stop_ids))
        with setup.connect(cfg, server) as pool:
            state, progress = _train(cfg, pool, state, progress, w, step)
        path = w.jsonl_path
    records = metrics.read_jsonl(path)
    # Every completion was cut: no batch had an active token, every step but the last skipped.
    assert step.calls == consumed and step.active == [0.0] * consumed, step.active
    assert all(r["overlong_frac"] == 1.0 for r in records), records
    assert progress.steps_skipped == consumed - 1 and int(state.step) == 1
    # Every consumed batch moved the version on, and the republished weights reached the server.
    assert progress.version == consumed + 1
    assert [r["version"] for r in records] == list(range(2, consumed + 2))
    swaps = _swapped_versions(tmp_path / "server-a.log")
    assert swaps == sorted(swaps) and swaps[-1] >= consumed, swaps
    # Exactly once; nothing older than max_staleness; nothing wasted.
    keys = progress.recent_group_keys
    assert len(keys) == consumed * B and len(set(keys)) == len(keys), keys
    assert max(r["lag_max"] for r in records) <= S, [r["lag_max"] for r in records]
    assert progress.stale_dropped == 0


def test_a_run_whose_every_step_is_skipped_stops_at_max_skipped_steps(tmp_path):
    """The run above with ``train.max_skipped_steps=3``: after three skipped steps the loop
    checkpoints and stops, naming the count and the cause it read off the live batches (every
    completion cut under ``train.overlong=mask``) with the keys that change it."""
    limit = 3
    overrides = _overrides(
        tmp_path,
        "train.client.wait_s=300",
        "train.overlong=mask",
        "rollout.max_new_tokens=2",
        f"train.max_skipped_steps={limit}",
    )
    server = _server(tmp_path, "a", overrides)
    step = _SkipWhenNothingActive([server], last=99)
    with (
        server,
        metrics.MetricsWriter(str(tmp_path / "logs"), total_steps=1, console=None) as w,
        checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=1) as ckpt,
    ):
        server.wait_ready(timeout_s=240)
        cfg = load_config(CONFIG, [*overrides, "train.steps=1"])
        state, progress = _start(cfg)
        state = state.replace(params=_never_stopping(state.params, make_tokenizer(cfg).stop_ids))
        _, _, weights_dir = setup.run_paths(cfg)
        push = functools.partial(_push_to, weights_dir=weights_dir)
        with (
            setup.connect(cfg, server) as pool,
            weight_sync.WeightPusher(functools.partial(push, pool)) as pusher,
        ):
            step.pusher = pusher
            progress = main.sync_weights(pool, state, progress, weights_dir)
            parts = _loop_parts(cfg, pool, pusher, w, step, ckpt=ckpt)
            with pytest.raises(skips.NoProgress) as stopped:
                main.train_loop(cfg, parts, state, progress)
        assert ckpt.all_steps() == [0]
    line = str(stopped.value)
    assert f"{limit} consecutive steps" in line and skips.CAUSES["cut"] in line, line
    assert "\n" not in line and step.calls == limit, (line, step.calls)
