"""rollout_server.group_queue and persistence: bounded FIFO and atomic state file."""

import threading

import pytest

from rollout_server.group_queue import GroupQueue
from rollout_server.persistence import RolloutState, StateStore


def test_fifo_bounded_and_batched():
    q = GroupQueue(3)
    for i in range(3):
        q.put(i)
    with pytest.raises(OverflowError):
        q.put(3)
    assert q.get_many(2, 0) == [0, 1]
    assert q.get_many(5, 0) == [2]
    assert q.get_many(5, 0.05) == []


class _SignallingCondition(threading.Condition):
    """Sets `waiting` whenever a thread starts waiting on it."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def test_get_many_wakes_on_put():
    q = GroupQueue(3)
    q._cond = cond = _SignallingCondition()
    got = []
    getter = threading.Thread(target=lambda: got.append(q.get_many(1, 3600)))
    getter.start()
    assert cond.waiting.wait(60)  # the getter is blocked on the empty queue ...
    q.put("x")  # ... and a put wakes it long before its hour is up (pytest-timeout: a hang fails)
    getter.join()
    assert got == [["x"]]


def test_state_store_round_trip(tmp_path):
    store = StateStore(str(tmp_path / "s"))
    assert store.load() == RolloutState()
    state = RolloutState(
        iterator={"next_index": 4},
        consumed=2,
        next_group_id=5,
        epoch_version=3,
        admission={"excluded": [1], "share": 0.5},
        unfinished=[{"group_id": 3, "id": "a", "text": "1+1=", "answer": "2"}],
    )
    store.save(state)
    store.close()  # the directory's lock: one store at a time
    assert StateStore(str(tmp_path / "s")).load() == state
    StateStore("").save(state)  # no directory: nothing kept
    assert StateStore("").load() == RolloutState()


def test_unget_restores_order():
    q = GroupQueue(5)
    for i in range(4):
        q.put(i)
    taken = q.get_many(3, 0)
    q.unget(taken[1:])
    assert q.get_many(5, 0) == [1, 2, 3]


def test_pull_stays_under_the_byte_limit():
    from rollout_api.proto import rollout_pb2
    from rollout_server.rollout import RolloutLoop
    from sat_jax.config import RolloutConfig
    from sat_jax.tasks import CharTokenizer, exact_match_reward, prompt_dataset
    from sat_jax.tasks.config import TaskConfig

    loop = RolloutLoop(
        driver=None, engine=None, prompts=prompt_dataset(TaskConfig()),
        reward_fn=exact_match_reward, tokenizer=CharTokenizer("0123456789"),
        cfg=RolloutConfig(), store=StateStore(""), wait_for_weights=True,
        max_response_bytes=2500, lease_s=600,
    )  # fmt: skip
    for i in range(5):
        loop.queue.put(rollout_pb2.Group(group_id=i, prompt_text="x" * 1000))
    assert [g.group_id for g in loop.pull(5, 0)] == [0, 1]
    assert [g.group_id for g in loop.pull(5, 0, ack=[0, 1])] == [2, 3]
    assert loop.persisted.consumed == 2  # leased groups count once acknowledged
    assert loop.ack([2, 3, 3, 77]) == 2 and loop.persisted.consumed == 4
    big = rollout_pb2.Group(group_id=9, prompt_text="x" * 5000)
    loop.queue.get_many(5, 0)
    loop.queue.put(big)
    assert loop.pull(5, 0) == [big]  # a lone oversized group is still returned
