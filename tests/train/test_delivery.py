"""The trainer's side of delivery against an in-process fake Rollout service: the bearer token and
run id on every call, acknowledgements riding on the next Pull (and flushed with Ack), groups
with out-of-range token or routing ids rejected and counted, and re-delivered groups skipped by
their name across a restart."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from rollout_api import records
from rollout_api.proto import rollout_pb2
from tests.train.test_batching import spec
from tests.train.test_remote import FakeRollout, pool, serve
from train import batching, checkpointing, pulling

VOCAB, EXPERTS = 64, 8


def _group(group_id: int, *, token: int = 5, expert: int = 1) -> records.Group:
    trajs = tuple(
        records.Trajectory(
            prompt_ids=np.array([1, token], np.int32),
            completion_ids=np.array([7], np.int32),
            behavior_logprobs=np.array([-0.5], np.float32),
            versions=np.array([3], np.int64),
            routing=np.full((3, 2, 2), expert, np.uint8),
            reward=float(i),
        )
        for i in range(2)
    )
    return records.Group(
        server_id="srv", group_id=group_id, prompt_id=f"p{group_id}", trajectories=trajs
    )


class ScriptedRollout(FakeRollout):
    """Serves `groups` (records) in order (at most `max_groups` a Pull) and records what clients send."""

    def __init__(self, groups):
        super().__init__()
        self.groups = [records.to_proto(g) for g in groups]  # as a server queues them
        self.metadata: list[tuple[str, str]] = []
        self.pull_acks: list[list[int]] = []
        self.pull_rejects: list[list[int]] = []
        self.acks: list[list[int]] = []
        self.ack_rejects: list[list[int]] = []
        self.run_ids: set[str] = set()
        self.fail_pulls = 0

    def _record(self, context, run_id):
        self.metadata.append((context._rpc_event.call_details.method.decode(),
                              dict(context.invocation_metadata()).get("authorization", "")))  # fmt: skip
        self.run_ids.add(run_id)

    def Pull(self, request, context):
        self._record(context, request.run_id)
        self.pull_acks.append(list(request.ack_group_ids))
        self.pull_rejects.append(list(request.reject_group_ids))
        if self.fail_pulls:
            self.fail_pulls -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "down for a moment")
        out, self.groups = self.groups[: request.max_groups], self.groups[request.max_groups :]
        return rollout_pb2.PullResponse(groups=out)

    def Ack(self, request, context):
        self._record(context, request.run_id)
        self.acks.append(list(request.group_ids))
        self.ack_rejects.append(list(request.reject_group_ids))
        return rollout_pb2.AckResponse(acked=len(request.group_ids) + len(request.reject_group_ids))


@pytest.fixture
def scripted():
    groups = [
        _group(0),
        _group(1, token=VOCAB),  # a token id past the vocabulary
        _group(2, expert=EXPERTS),  # a routing id past the experts
        _group(3),
        _group(4),
        _group(0),  # group 0 again (a re-delivery)
        _group(5),
    ]
    servicer = ScriptedRollout(groups)
    for address in serve(servicer):
        yield servicer, address


def test_bad_ids_are_rejected_and_acknowledgements_ride_on_pulls(scripted):
    servicer, address = scripted
    progress = checkpointing.Progress(version=3, min_version=1, rng_key=(0, 0))
    batch_spec = spec(vocab_size=VOCAB, num_experts=EXPERTS, routing_lk=(2, 2))
    with pool([address], token="s3cret", run_id="run-1") as p:
        selection = pulling.pull_batch(p, batch_spec, progress, timeout_s=0.1, stall_s=5)
        assert [g.group_id for g in selection.kept] == [0, 3, 4]
        assert (selection.invalid, selection.duplicates) == (2, 0)
        _, stats = batching.assemble_batch(selection, batch_spec, trainer_version=3)
        assert stats.invalid == 2 and stats.group_keys == ("srv/0", "srv/3", "srv/4")
        p.ack(selection.pulled)  # trained: acknowledged with the next Pull
        progress = checkpointing.Progress(
            version=4, min_version=1, rng_key=(0, 0), recent_group_keys=stats.group_keys
        )
        again = pulling.pull_batch(
            p, spec(batch_groups=1, vocab_size=VOCAB, num_experts=EXPERTS), progress,
            timeout_s=0.1, stall_s=5,
        )  # fmt: skip
        assert [g.group_id for g in again.kept] == [5] and again.duplicates == 1
        p.ack(again.pulled)
        p.flush_acks()
    # Groups never to be trained (the two invalid ones, the re-delivered group 0) are rejected
    # with the very next Pull, so they cannot hold the server's admission while the batch waits
    # and the server replaces them; trained groups are acknowledged after their step.
    assert servicer.pull_rejects == [[], [1, 2], [], [0]]
    assert servicer.pull_acks == [[], [], [0, 3, 4], []]
    assert servicer.acks == [[5]] and servicer.ack_rejects == [[]]
    assert {auth for _, auth in servicer.metadata} == {"Bearer s3cret"}
    assert servicer.run_ids == {"run-1"}


def test_a_failed_pull_keeps_its_acknowledgements_for_the_next(scripted):
    servicer, address = scripted
    with pool([address]) as p:
        first = p.pull(3, 0.1)
        p.ack(first[:2])
        p.ack(first[2:], rejected=True)
        p.ack([_group(99)])  # never pulled through this pool: ignored
        servicer.fail_pulls = 1  # the next Pull fails (after reading its acks): retried
        p.pull(1, 0.1)
        p.flush_acks()  # nothing pending: no Ack call
    assert servicer.pull_acks == [[], [0, 1], [0, 1]] and servicer.acks == []
    assert servicer.pull_rejects == [[], [2], [2]]


def test_flush_sends_pending_rejections_with_ack(scripted):
    servicer, address = scripted
    with pool([address]) as p:
        first = p.pull(3, 0.1)
        p.ack(first[:1])
        p.ack(first[1:], rejected=True)
        p.flush_acks()
    assert servicer.acks == [[0]] and servicer.ack_rejects == [[1, 2]]


def test_a_push_sends_no_ack_first_the_acknowledgements_ride_the_next_pull(scripted):
    """`update_weights` is one UpdateWeights per server: an Ack in front of it would put a round
    trip and the server's write between a step and the install that opens admission. The
    batch's acknowledgements, pending meanwhile, go with the next Pull."""
    servicer, address = scripted
    with pool([address]) as p:
        first = p.pull(2, 0.1)
        p.ack(first[:1])
        p.ack(first[1:], rejected=True)
        p.update_weights(1, "/ckpt/v1")
        assert servicer.acks == [] and servicer.ack_rejects == []
        p.pull(1, 0.1)
    assert servicer.updates == [(1, "/ckpt/v1", False)]
    assert servicer.pull_acks == [[], [0]] and servicer.pull_rejects == [[], [1]]
