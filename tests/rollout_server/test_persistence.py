"""Group commit of the rollout state (docs/DESIGN.md §6.4), without a server: one write in flight,
the newest snapshot written next, a failed write retried, replies that wait for the write covering
what they reveal, and Pulls that never wait for the disk otherwise.

A `GatedStore` holds each write until the test releases it, so what happens while a write is in
flight is decided by the test, not by timing. Threads that must block are joined with a generous
limit only so that a wrong implementation fails instead of hanging."""

from __future__ import annotations

import errno
import json
import logging
import threading

from rollout_api.proto import rollout_pb2
from rollout_server.persistence import RolloutState, StateStore
from sat_jax.config import RolloutConfig
from tests.clock import wait_until
from tests.rollout_server.test_delivery import LongPromptEngine, _sample
from tests.rollout_server.test_rollout import FakeEngine, RecordingDriver, _loop

HANG_S = 60  # a thread not done by then is stuck (a failure), not slow


class GatedStore(StateStore):
    """A state store whose every write starts (`entered`) and then waits for one `release`."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self.entered = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.saved: list[RolloutState] = []
        self._count = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.full = False

    def save(self, state: RolloutState) -> None:
        with self._count:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.entered.release()
        self.release.acquire()
        try:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().save(state)
            self.saved.append(state)
        finally:
            with self._count:
                self.in_flight -= 1

    def next_write(self) -> None:
        """Waits until a write has started, then lets it end."""
        assert self.entered.acquire(timeout=HANG_S), "no write started"
        self.release.release()


def _saved(store: StateStore) -> dict:
    return json.loads(store.path.read_text())


def test_one_write_in_flight_and_the_newest_snapshot_next(tmp_path):
    store = GatedStore(str(tmp_path))
    first = store.submit(RolloutState(consumed=1))
    assert store.entered.acquire(timeout=HANG_S)  # the first write is in flight ...
    later = [store.submit(RolloutState(consumed=n)) for n in (2, 3)]  # ... these wait for it
    store.release.release()
    assert store.wait(first)
    store.next_write()  # one write for both: the newest snapshot covers the one before
    assert all(store.wait(seq) for seq in later)
    assert [s.consumed for s in store.saved] == [1, 3] and store.max_in_flight == 1
    assert store.load().consumed == 3 and store.writes == 2


def test_a_snapshot_is_the_state_when_submitted(tmp_path):
    store = StateStore(str(tmp_path))
    state = RolloutState(consumed=1, unfinished=[{"group_id": 0}], admission={"excluded": [0]})
    seq = store.submit(state)
    state.consumed = 2
    state.unfinished.append({"group_id": 1})
    state.admission["excluded"].append(1)
    assert store.wait(seq)
    saved = _saved(store)
    assert (saved["consumed"], saved["unfinished"], saved["admission"]["excluded"]) == (
        1,
        [{"group_id": 0}],
        [0],
    )


def test_a_failed_write_answers_its_waiters_and_is_retried(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rollout_server.persistence")
    store = GatedStore(str(tmp_path))
    store.full = True
    seq = store.submit(RolloutState(consumed=1))
    store.next_write()
    assert store.wait(seq) is False and store.failed  # answered, as the synchronous save was
    assert not store.path.exists()
    retry = store.retry()  # the loop's next turn: the same snapshot again
    store.next_write()
    assert store.wait(retry) is False
    store.full = False
    retry = store.retry()
    store.next_write()
    assert store.wait(retry) and not store.failed and _saved(store)["consumed"] == 1
    assert store.retry() == 0  # nothing failed: nothing to retry
    errors = [r for r in caplog.records if "cannot save the rollout state" in r.message]
    assert len(errors) == 1  # logged once per failure streak
    assert any("saved again" in r.message for r in caplog.records)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_pull_does_not_wait_for_the_disk_an_ack_does(tmp_path):
    store = GatedStore(str(tmp_path))
    cfg = RolloutConfig(batch_groups=4, max_staleness=0, group_size=2)
    loop = _loop(store, LongPromptEngine(), wait=False, cfg=cfg, driver=RecordingDriver())
    for i in range(4):  # finished groups whose dispatch is on disk (as after a restart)
        loop.queue.put(rollout_pb2.Group(group_id=100 + i, prompt_id=f"p{i}"))
    loop._dispatch_next()  # a change no reply waits for: its write is now in flight, held
    assert store.entered.acquire(timeout=HANG_S)
    pulled: list = []
    pull = threading.Thread(target=lambda: pulled.extend(loop.pull(2, 0)))
    pull.start()
    pull.join(HANG_S)
    assert not pull.is_alive() and [g.group_id for g in pulled] == [100, 101]
    acked: list[int] = []
    ack = threading.Thread(target=lambda: acked.append(loop.ack([100, 101])))
    ack.start()
    wait_until(lambda: store.submitted == 2)  # the acknowledgement is in memory ...
    store.release.release()  # ... the dispatch's write ends; the ack's starts
    assert store.entered.acquire(timeout=HANG_S)
    assert ack.is_alive() and acked == []  # ... and its reply waits for that write
    store.release.release()
    ack.join(HANG_S)
    assert acked == [2] and _saved(store)["consumed"] == 2


def test_a_pull_waits_for_the_dispatch_of_the_groups_it_returns(tmp_path):
    store = GatedStore(str(tmp_path))
    cfg = RolloutConfig(batch_groups=1, max_staleness=0, group_size=2)
    driver = RecordingDriver()
    loop = _loop(store, LongPromptEngine(), wait=False, cfg=cfg, driver=driver)
    loop._dispatch_next()
    assert store.entered.acquire(timeout=HANG_S)  # its write is held
    for request in driver.requests:
        request.on_done(request, _sample())
    loop._collect(timeout_s=HANG_S)
    assert len(loop.queue) == 1  # finished before its dispatch is on disk
    pulled: list = []
    pull = threading.Thread(target=lambda: pulled.extend(loop.pull(1, 0)))
    pull.start()
    wait_until(lambda: loop.stats()["groups_leased"] == 1)
    assert pull.is_alive() and pulled == []  # leased, but not revealed before the write
    store.release.release()
    pull.join(HANG_S)
    assert [g.group_id for g in pulled] == [0]
    saved = _saved(store)
    assert saved["next_group_id"] == 1 and saved["server_id"] == pulled[0].server_id


def test_stop_writes_every_change_not_written_yet(tmp_path):
    cfg = RolloutConfig(batch_groups=1, max_staleness=0, group_size=2)
    loop = _loop(StateStore(str(tmp_path)), LongPromptEngine(), wait=False, cfg=cfg,
                 driver=RecordingDriver())  # fmt: skip
    loop._dispatch_next()  # nothing waits for its write
    loop.stop()
    saved = _saved(loop._core.store)
    assert saved["next_group_id"] == 1 and [r["group_id"] for r in saved["unfinished"]] == [0]


def test_without_a_directory_nothing_is_written_and_nothing_waits():
    store = StateStore("")
    loop = _loop(store, FakeEngine(), wait=False)
    loop.queue.put(rollout_pb2.Group(group_id=0))
    assert [g.group_id for g in loop.pull(1, 0)] == [0]
    assert loop.ack([0]) == 1 and store.writes == 0 and store.durable == store.submitted


def test_a_state_file_of_an_older_server_still_loads(tmp_path):
    """Older servers saved admission's fields at the top level and an `epoch_used` count no
    longer kept: a server restarted on such a state_dir starts from what it says, and the
    rollout loop's admission takes it up (`ServerAdmission.set_state`)."""
    old = {
        "iterator": None,
        "unfinished": [{"group_id": 3, "id": "a", "text": "1+1=", "answer": "2"}],
        "consumed": 2,
        "next_group_id": 4,
        "version": 5,
        "checkpoint_path": "/ckpt/v5",
        "base_path": "",
        "epoch_version": 5,
        "epoch_used": 7,
        "epoch_excluded": [1, 2],
        "share": 0.5,
        "share_until": 6,
        "server_id": "abc",
        "run_id": "run-a",
        "trainer_version": 6,
        "trained_since": 1,
    }
    (tmp_path / "rollout_state.json").write_text(json.dumps(old))
    store = StateStore(str(tmp_path))
    state = store.load()
    assert (state.consumed, state.next_group_id, state.version, state.server_id) == (2, 4, 5, "abc")
    assert state.admission == {
        "share": 0.5,
        "share_until": 6,
        "trainer_version": 6,
        "trained_since": 1,
        "excluded": [1, 2],
    }
    loop = _loop(store, FakeEngine(), wait=True)
    adm = loop.admission
    assert (adm.share, adm.share_until, adm.weights_version, adm.trainer_version) == (0.5, 6, 5, 6)
    assert (adm.trained_since, adm.excluded) == (1, {1, 2})
    assert [r["group_id"] for r in loop.persisted.unfinished] == [3]  # re-issued first
    store.save(loop.persisted)  # saved in today's form: admission's part under `admission`
    saved = _saved(store)
    assert "epoch_used" not in saved and "share" not in saved
    assert saved["admission"]["excluded"] == [1, 2]
