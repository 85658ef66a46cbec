"""Admission across restarts and across a fleet, without a server (docs/DESIGN.md §6.3): groups
outstanding when an admission epoch begins buy no replacement when rejected; trained, they move
the trainer's version on; an acknowledgement of a group the restarted server is generating again
stops it; a server's share of the fleet scales its budget; only what is outstanding counts, so
what the trainer took from each server before leaves no credit or debt."""

from __future__ import annotations

import pytest

from rollout_api.proto import rollout_pb2
from rollout_server.persistence import RolloutState, StateStore
from sat_jax.config import RolloutConfig
from tests.rollout_server.test_rollout import FakeEngine, _loop

B = 4
CFG = RolloutConfig(batch_groups=B, max_staleness=1)


def _budget(loop) -> float:
    return loop.admission_budget()


def _queue(loop, ids):
    for i in ids:
        loop.queue.put(rollout_pb2.Group(group_id=i, prompt_id=f"p{i}"))


def test_rejecting_the_groups_of_before_a_new_epoch_buys_no_replacement(tmp_path):
    """A restarted trainer drops what the server made for its lost weights: the server must not
    then run further ahead than (max_staleness + 1) batches (the 2.8 stale drops per step that
    followed every resume)."""
    loop = _loop(StateStore(str(tmp_path)), FakeEngine(), wait=True, cfg=CFG)
    loop.install_weights(1, "/ckpt/v1", params=None, run_id="run")
    _queue(loop, range(2 * B))  # the epoch's whole budget, made and queued
    assert _budget(loop) == 0
    # The trainer is killed and resumes past the server: a new epoch at v20.
    loop.install_weights(20, "/ckpt/v20", params=None, new_epoch=True, run_id="run")
    assert loop.persisted.admission["excluded"] == list(range(2 * B))
    assert _budget(loop) == 2 * B
    # It rejects every old group as too stale: the budget stays (max_staleness + 1) batches.
    pulled = loop.pull(2 * B, 0)
    assert loop.ack([], reject=[g.group_id for g in pulled]) == 2 * B
    assert _budget(loop) == 2 * B
    assert loop.persisted.admission["excluded"] == [] and loop.trainer.groups_rejected == 2 * B
    # The epoch's own groups, rejected, are replaced as before.
    _queue(loop, [100, 101])
    assert _budget(loop) == 2 * B - 2
    loop.ack([], reject=[100])
    assert _budget(loop) == 2 * B - 1
    # The counts persist: a restarted server goes on from them.
    again = StateStore(str(tmp_path / "copy"))
    again.save(loop.persisted)
    assert again.load().admission["excluded"] == []


def test_training_a_group_of_before_the_epoch_moves_the_trainer_on():
    """Groups of before the epoch trained at v2 leave no place of their own, but they tell the
    server the trainer is past v2: a group of v2 weights admitted now would be trained a
    version later than the ones admitted at once, so the run-ahead shrinks by a batch until v3's
    weights come."""
    loop = _loop(StateStore(""), FakeEngine(), wait=True, cfg=CFG)
    loop.install_weights(1, "/ckpt/v1", params=None)
    _queue(loop, range(3))
    loop.install_weights(2, "/ckpt/v2", params=None, new_epoch=True)
    assert _budget(loop) == 2 * B
    loop.pull(3, 0, trainer_version=2)
    loop.ack([0, 1], reject=[2])  # two trained at v2
    assert loop.admission.trainer_version == 3 and _budget(loop) == B
    assert loop.persisted.admission["excluded"] == []
    loop.install_weights(3, "/ckpt/v3", params=None)
    assert _budget(loop) == 2 * B


def test_an_ack_stops_a_group_the_restarted_server_makes_again(tmp_path):
    """Pulled before the server died and trained meanwhile: the acknowledgement waited for the
    server, which re-issued the group on restart; it is counted once, not generated again."""
    store = StateStore(str(tmp_path))
    record = {"group_id": 7, "id": "p7", "text": "1+1=", "answer": "2"}
    store.save(RolloutState(unfinished=[record], next_group_id=8, version=3, checkpoint_path="/c"))
    store.close()
    loop = _loop(StateStore(str(tmp_path)), FakeEngine(), wait=True, cfg=CFG)
    assert [r["group_id"] for r in loop._core.prompts.reissue] == [7]
    assert loop.ack([7]) == 1
    assert list(loop._core.prompts.reissue) == [] and loop.persisted.consumed == 1
    assert loop.persisted.unfinished == []  # saved so: a restart does not re-issue it
    loop._core.generation.running[9] = object()  # re-issued and running
    assert loop.ack([], reject=[9]) == 1 and 9 not in loop._core.generation.running


def _consume(loop, n: int) -> None:
    """The trainer pulls ``n`` of the server's groups and trains them (leased, then acknowledged,
    as the trainer does: the acknowledgement rides on a later Pull)."""
    pulled = loop.pull(n, 0, trainer_version=loop.admission.weights_version)
    assert len(pulled) == n
    loop.ack([g.group_id for g in pulled])


def _fill(loop, first_id: int) -> int:
    """Queues groups while admission allows (what the rollout loop would make); returns the next
    free id."""
    while _budget(loop) > 0:
        _queue(loop, [first_id])
        first_id += 1
    return first_id


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_share_of_the_fleet_scales_the_budget(k):
    """k servers with a share of 1/k each admit, together, what one server alone would (each
    its share rounded down), and a batch more per version as the trainer consumes one."""
    loops = [_loop(StateStore(""), FakeEngine(), wait=True, cfg=CFG) for _ in range(k)]
    for loop in loops:
        loop.install_weights(1, "/ckpt/v1", params=None, share=1 / k)
    alone = k * (2 * B // k)
    assert sum(_budget(loop) for loop in loops) == alone and 2 * B - k < alone <= 2 * B
    for loop in loops:
        loop.install_weights(2, "/ckpt/v2", params=None, share=1 / k)  # nothing consumed yet
    assert sum(_budget(loop) for loop in loops) == alone
    # Each server filled its part; the trainer consumes one batch (B / k from each, B = 4).
    ids = [_fill(loop, 0) for loop in loops]
    taken = [B // k + (i < B % k) for i in range(k)]
    for loop, n in zip(loops, taken, strict=True):
        _consume(loop, n)
    for loop in loops:
        loop.install_weights(3, "/ckpt/v3", params=None, share=1 / k)
    budgets = [_budget(loop) for loop in loops]
    assert sum(budgets) == sum(2 * B // k - i for i in ids) + sum(taken)


def test_what_the_trainer_took_from_a_server_before_leaves_no_credit_or_debt():
    """Two servers, share 1/2. While b was warming up the trainer took a's groups only, then
    b's groups only: under the old per-epoch count b kept the versions it was not consumed at as
    credit and ran ahead (its groups went stale, and each one rejected bought a replacement: a
    steady stale drop every other step after a server rejoined), and a ran short (the trainer
    waited for its groups). Counting only what is outstanding, each runs ahead by its share
    again."""
    a, b = (_loop(StateStore(""), FakeEngine(), wait=True, cfg=CFG) for _ in range(2))
    next_id = {id(a): 0, id(b): 0}
    for loop in (a, b):
        loop.install_weights(1, "/ckpt/v1", params=None, share=0.5)
        next_id[id(loop)] = _fill(loop, 0)  # B each: (max_staleness + 1) · B / 2
    for v in range(2, 6):  # 4 versions: the trainer took a batch of a's groups at each
        _consume(a, B)
        for loop in (a, b):
            loop.install_weights(v, f"/ckpt/v{v}", params=None, share=0.5)
            next_id[id(loop)] = _fill(loop, next_id[id(loop)])
        # b made nothing more: it holds its share, however long it was not consumed.
        assert len(b.queue) == B and _budget(b) == 0
    _consume(b, B)  # then a batch of b's only
    for loop in (a, b):
        loop.install_weights(6, "/ckpt/v6", params=None, share=0.5)
    assert _budget(a) == 0 and _budget(b) == B  # no debt for a: it holds its B already


def test_a_push_counts_leased_groups_as_outstanding():
    """The trainer acknowledges the groups it trained before it pushes the weights they made
    (``ServerPool.update_weights``): then the push grants a batch. A group still leased at a
    push (pulled for the next step) counts as outstanding, so that the server does not run a
    batch ahead; an acknowledgement late for its push only delays the batch by one version."""
    loop = _loop(StateStore(""), FakeEngine(), wait=True, cfg=CFG)
    loop.install_weights(1, "/ckpt/v1", params=None)
    _fill(loop, 0)
    trained = loop.pull(B, 0)
    loop.ack([g.group_id for g in trained])
    loop.install_weights(2, "/ckpt/v2", params=None)
    assert _budget(loop) == B
    _fill(loop, 100)
    loop.pull(B, 0)  # the next step's batch, leased when the push lands
    loop.install_weights(3, "/ckpt/v3", params=None)
    assert _budget(loop) == 0
    _queue(loop, [50])
    loop.ack([], reject=[50])  # a rejected group is replaced
    assert _budget(loop) == 0


def test_a_new_share_counts_what_is_outstanding():
    loop = _loop(StateStore(""), FakeEngine(), wait=True, cfg=CFG)
    loop.install_weights(1, "/ckpt/v1", params=None, share=0.5)
    _queue(loop, range(B))  # its whole half of (max_staleness + 1) batches
    assert _budget(loop) == 0
    # The other server left: this one now holds the fleet's whole budget, minus what it has.
    loop.install_weights(5, "/ckpt/v5", params=None, share=1.0)
    assert loop.persisted.admission["share"] == 1.0
    assert _budget(loop) == 2 * B - B
    loop.install_weights(6, "/ckpt/v6", params=None, share=0)  # unset (an older trainer): 1
    assert loop.persisted.admission["share"] == 1.0 and _budget(loop) == 2 * B - B


def test_a_rejoining_server_learns_the_trainers_version_with_its_weights():
    """The pool's rejoin push carries the last pushed weights, which lag the trainer: admitting
    its whole share of them at once made groups stale before its first Pull named the trainer's
    version (12 stale drops at step 3 of the live two-server run)."""
    cfg = RolloutConfig(batch_groups=B, max_staleness=2)
    loop = _loop(StateStore(""), FakeEngine(), wait=True, cfg=cfg)
    loop.install_weights(3, "/ckpt/v3", None, new_epoch=True, share=0.5, trainer_version=5)
    assert loop.admission.lead == 2 and _budget(loop) == B // 2
    loop.install_weights(5, "/ckpt/v5", None, share=0.5, trainer_version=5)
    assert _budget(loop) == 3 * B // 2
