"""Killing the server (SIGKILL) loses no prompt: the restart re-issues every prompt whose group was
not acknowledged (pulled or not)."""

from __future__ import annotations

import json

import pytest

from rollout_api.proto import rollout_pb2
from tests.rollout_server.conftest import stats, wait_for

pytestmark = pytest.mark.slow  # starts server processes

BATCH = 4


def test_sigkill_then_restart_reissues_unacknowledged_prompts(server_factory, tmp_path):
    overrides = [
        f"server.state_dir={tmp_path / 'state'}",
        "server.checkpoint_root=",
        "server.wait_for_weights=false",
        f"rollout.batch_groups={BATCH}",
        "rollout.max_staleness=1",
    ]
    budget = 2 * BATCH
    first = server_factory(overrides)
    stub = first.rollout_stub()
    # Kill while some groups are still running and some are queued.
    wait_for(lambda: stats(stub).groups_produced >= 3, interval_s=0.05)
    pulled = stub.Pull(rollout_pb2.PullRequest(max_groups=2, timeout_s=10)).groups
    assert len(pulled) == 2
    pulled_ids = {g.prompt_id for g in pulled}
    stub.Ack(rollout_pb2.AckRequest(group_ids=[g.group_id for g in pulled]))
    [leased] = stub.Pull(rollout_pb2.PullRequest(max_groups=1, timeout_s=10)).groups  # no ack
    first.kill()
    state = json.loads((tmp_path / "state" / "rollout_state.json").read_text())
    assert state["consumed"] == 2
    drawn = {f"arith-0-{i}" for i in range(state["next_group_id"])}
    unfinished = {r["id"] for r in state["unfinished"]}
    assert unfinished == drawn - pulled_ids and leased.prompt_id in unfinished

    second = server_factory(overrides)
    stub = second.rollout_stub()
    groups = []
    wait_for(
        lambda: (
            groups.extend(stub.Pull(rollout_pb2.PullRequest(max_groups=budget, timeout_s=2)).groups)
            or len(groups) >= budget - 2
        ),
        timeout_s=120,
    )
    ids = [g.prompt_id for g in groups]
    assert len(ids) == len(set(ids)) == budget - 2
    assert not set(ids) & pulled_ids
    # The re-issued prompts come back (same ids and group ids), then new ones continue.
    assert unfinished <= set(ids)
    assert set(ids) - unfinished == {f"arith-0-{i}" for i in range(state["next_group_id"], budget)}
    assert second.stop() == 0
