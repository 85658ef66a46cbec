"""Admission (docs/DESIGN.md §6) counted from the admission epoch, without a server: the budget
formula, the epochs `install_weights` starts, `wait_for_weights`, the epoch surviving a restart, and
prompts too long for a prefill."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable

import grain
import pytest

from rollout_api.admission import ServerAdmission
from rollout_api.proto import rollout_pb2
from rollout_server.engine import MoEEngine
from rollout_server.generation import RunningGroup
from rollout_server.persistence import StateStore
from rollout_server.rollout import RolloutLoop
from sat_jax.config import RolloutConfig, ServerConfig
from sat_jax.tasks import CharTokenizer, Prompt, exact_match_reward, prompt_dataset
from sat_jax.tasks.config import TaskConfig
from tests.clock import FakeClock, wait_until

B = 4
CFG = RolloutConfig(batch_groups=B, max_staleness=1)


@pytest.mark.parametrize(
    "staleness, share, weights, trainer, outstanding, excluded, budget",
    [
        (1, 1.0, 1, 1, 0, 0, 2 * B),  # first trainer weights v1: (s + 1)·B groups of v1
        (1, 1.0, 1, 1, 3, 0, 2 * B - 3),  # outstanding groups count ...
        (1, 1.0, 1, 1, 3, 2, 2 * B - 1),  # ... except those of before the epoch
        (1, 1.0, 5, 6, 0, 0, B),  # the trainer one version ahead (its push on the way)
        (1, 1.0, 5, 7, 0, 0, 0),  # two ahead at max_staleness 1: closed until newer weights
        (0, 1.0, 3, 3, 0, 0, B),  # sync: one batch per version
        (0, 1.0, 3, 4, 0, 0, 0),  # sync, batch consumed, next version not in yet: closed
        (2, 0.5, 9, 9, 5, 0, 3 * B // 2 - 5),  # a share of the fleet's batch
        (1, 1 / 3, 9, 9, 0, 0, 2),  # rounded down: ⌊2 · 4 / 3⌋
    ],
)
def test_admission_budget(staleness, share, weights, trainer, outstanding, excluded, budget):
    adm = ServerAdmission(max_staleness=staleness, batch_groups=B, capacity=64)
    adm.install(weights, share)
    adm.saw_trainer(trainer)
    adm.begin_epoch(weights, range(excluded)) if excluded else None
    adm.saw_trainer(trainer)
    assert adm.budget(range(outstanding)) == budget


class FakeEngine:
    prefill_calls = prefill_tokens = extend_tokens = 0

    def __init__(self):
        self.version = 0
        self.swaps: list[int] = []

    def swap_params(self, version, params):
        self.version = version
        self.swaps.append(version)


class FakeDriver:
    tokens_generated = 0


def _loop(
    store: StateStore,
    engine: FakeEngine,
    *,
    wait: bool,
    cfg: RolloutConfig = CFG,
    driver: FakeDriver | None = None,
    prompts: grain.IterDataset | None = None,
    lease_s: float = 600.0,
    clock: Callable[[], float] = time.monotonic,
) -> RolloutLoop:
    return RolloutLoop(
        driver=FakeDriver() if driver is None else driver,
        engine=engine,
        prompts=prompt_dataset(TaskConfig()) if prompts is None else prompts,
        reward_fn=exact_match_reward,
        tokenizer=CharTokenizer("0123456789+-="),
        cfg=cfg,
        store=store,
        wait_for_weights=wait,
        max_response_bytes=ServerConfig().max_message_bytes,
        lease_s=lease_s,
        clock=clock,
    )


def test_epochs_and_waiting_for_weights(tmp_path):
    store = StateStore(str(tmp_path))
    engine = FakeEngine()
    loop = _loop(store, engine, wait=True)
    assert not loop.stats()["admission_open"]  # no trainer weights yet
    # Pretend 3 groups of the random weights were consumed and 2 are queued (as a server with
    # wait_for_weights=false would have): the first trainer weights start an epoch past them.
    loop.persisted.consumed = 3
    for i in range(2):
        loop.queue.put(rollout_pb2.Group(group_id=i))
    loop.install_weights(5, "/ckpt/v5", params=None)
    assert engine.swaps == [5]
    state = loop.persisted
    assert (state.version, state.checkpoint_path) == (5, "/ckpt/v5")
    assert state.epoch_version == 5 and state.admission["excluded"] == [0, 1]
    assert loop.stats()["admission_open"]
    assert loop.admission_budget() == 2 * B  # the 2 queued groups are not counted
    # A later push keeps the epoch (the excluded groups stay out of the count); one with
    # new_epoch starts another, excluding what is outstanding then.
    loop.install_weights(6, "/ckpt/v6", params=None)
    assert loop.persisted.epoch_version == 5 and loop.persisted.admission["excluded"] == [0, 1]
    loop.queue.put(rollout_pb2.Group(group_id=2))
    assert loop.admission_budget() == 2 * B - 1
    loop.install_weights(7, "/ckpt/v7", params=None, new_epoch=True)
    assert loop.persisted.epoch_version == 7 and loop.persisted.admission["excluded"] == [0, 1, 2]
    assert loop.admission_budget() == 2 * B
    # The epoch persists: a restarted server keeps counting from it.
    again = store.load()
    assert (again.version, again.epoch_version, again.admission["excluded"]) == (7, 7, [0, 1, 2])


def test_without_waiting_the_initial_weights_generate():
    loop = _loop(StateStore(""), FakeEngine(), wait=False)
    assert loop.stats()["admission_open"]


class _ContendedLock:
    """A lock that sets `contended` when a thread has to wait for it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_admission_never_sees_pulled_groups_in_neither_count(tmp_path):
    # Sync-mode shape: max_staleness 0, the batch of v1 finished and queued, so admission is
    # closed. While a Pull takes the groups off the queue, admission must not find them in
    # neither `queued` nor `leased` (it would start a group of the old version too many).
    cfg = RolloutConfig(batch_groups=B, max_staleness=0)
    loop = _loop(StateStore(str(tmp_path)), FakeEngine(), wait=True, cfg=cfg)
    loop.install_weights(1, "/ckpt/v1", params=None)
    for i in range(B):
        loop.queue.put(rollout_pb2.Group(group_id=i, prompt_id=f"p{i}"))
    assert not loop.stats()["admission_open"]
    seen: list[bool] = []
    take = loop.queue.remove_if
    loop._core.lock = lock = _ContendedLock()

    def take_then_look(predicate):
        items = take(predicate)
        # The rollout loop's thread checks admission right now (it takes the loop's lock).
        # A probe the lock does not stop looks now; one that waits for the lock looks after the
        # pull, and must then see the groups leased. Which of the two it is, not time, decides.
        probe = threading.Thread(target=lambda: seen.append(loop._may_dispatch()))
        probe.start()
        probes.append(probe)
        wait_until(lambda: lock.contended.is_set() or not probe.is_alive())
        return items

    probes: list[threading.Thread] = []
    loop.queue.remove_if = take_then_look
    assert len(loop.pull(B, timeout_s=1.0)) == B
    assert loop.stats()["groups_leased"] == B and loop.persisted.consumed == 0
    [probe] = probes
    probe.join()
    assert seen == [False]
    assert not loop.stats()["admission_open"]  # leased groups still count ...
    assert loop.ack(list(range(B))) == B
    assert loop.persisted.consumed == B
    assert not loop.stats()["admission_open"]  # ... and then as consumed


class ShortPromptEngine(FakeEngine):
    """Takes prompts of at most 4 tokens (BOS included), with the real engine's check."""

    core = types.SimpleNamespace(max_prefill_length=4)
    check_prompt_length = MoEEngine.check_prompt_length


class RecordingDriver(FakeDriver):
    def __init__(self):
        self.requests = []

    def place_request_on_prefill_queue(self, request):
        self.requests.append(request)


def test_prompts_longer_than_a_prefill_are_skipped(tmp_path):
    driver = RecordingDriver()
    prompts = [
        Prompt(id="long", text="123+4=", answer="127"),
        Prompt(id="ok", text="1=", answer="1"),
    ]
    loop = _loop(
        StateStore(str(tmp_path)),
        ShortPromptEngine(),
        wait=False,
        driver=driver,
        prompts=grain.MapDataset.source(prompts).to_iter_dataset(),
    )
    loop._dispatch_next()  # BOS + 6 tokens > 4: skipped, counted, nothing submitted
    assert loop.prompts_skipped == 1 and driver.requests == []
    assert loop.stats()["prompts_skipped"] == 1
    assert loop.stats()["groups_running"] == 0
    loop._dispatch_next()  # BOS + 2 tokens: G samples submitted
    assert loop.prompts_skipped == 1 and len(driver.requests) == CFG.group_size
    want = CharTokenizer("0123456789+-=").encode_prompt("1=")  # the prompt ids, BOS included
    assert all(r.prefill_content == want for r in driver.requests)


def test_the_loop_measures_its_capacity_and_reports_it(tmp_path):
    """The samples in flight and the driver's token count make the capacity measure
    (`RateMeter`) that the Stats and every Pull reply carry: here one group of 4 samples on 8
    slots, 40 tokens a second, is a capacity of 80 tokens a second."""

    class SlotsEngine(FakeEngine):
        max_concurrent_decodes = 8

    clock = FakeClock()
    driver = FakeDriver()
    loop = _loop(StateStore(str(tmp_path)), SlotsEngine(), wait=True, driver=driver, clock=clock)
    assert loop.stats()["capacity_tokens_per_s"] == 0.0  # not measured yet
    loop._core.generation.running[0] = RunningGroup(record={}, prompt_ids=[])  # 4 samples in flight
    for _ in range(6):
        loop._measure()
        clock.advance(1.0)
        driver.tokens_generated += 40
    assert loop.capacity_tokens_per_s == pytest.approx(80.0)
    assert loop.stats()["capacity_tokens_per_s"] == pytest.approx(80.0)


class RoomyEngine(FakeEngine):
    """Takes every arithmetic prompt, with the real engine's check."""

    core = types.SimpleNamespace(max_prefill_length=64)
    check_prompt_length = MoEEngine.check_prompt_length


@pytest.mark.parametrize("opened_by", ["weights", "an acknowledgement"])
def test_an_idle_loop_dispatches_as_soon_as_admission_opens(tmp_path, monkeypatch, opened_by):
    """With nothing running, no finished sample ends the loop's wait, so the change that opens
    admission wakes it. Here that wait is an hour: without the wake-up nothing would be
    dispatched within the test's limit. Stopping wakes it too (or `stop` would wait out its
    join timeout)."""
    monkeypatch.setattr(RolloutLoop, "_COLLECT_S", 3600.0)
    driver = RecordingDriver()
    loop = _loop(StateStore(str(tmp_path)), RoomyEngine(), wait=True, driver=driver)
    size = CFG.group_size
    loop.start()
    try:
        # Weights 1 with the trainer at 2 (its push of 2 on the way): B groups, then closed.
        loop.install_weights(1, "/ckpt/v1", params=None, trainer_version=2)
        wait_until(lambda: len(driver.requests) == B * size)
        assert loop.admission_budget() == 0
        if opened_by == "weights":  # weights 2: B more
            loop.install_weights(2, "/ckpt/v2", params=None, trainer_version=2)
            more = B
        else:  # the trainer rejects a group (stale, filtered): its replacement
            assert loop.ack([], reject=[0]) == 1
            more = 1
        wait_until(lambda: len(driver.requests) == (B + more) * size)
    finally:
        loop.stop()
    assert not loop.alive()
