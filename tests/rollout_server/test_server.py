"""The rollout server live: real gRPC against `python -m rollout_server` in a subprocess."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import portpicker
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from rollout_api.proto import rollout_pb2, rollout_pb2_grpc
from rollout_api.routing_codec import decode_routing
from sat_jax.params_io import save_params
from sat_jax.tasks import CharTokenizer
from tests.rollout_server.conftest import ServerProcess, random_params, stats, unpacked, wait_for
from tests.rollout_server.conftest import pull_all as _pull_all

pytestmark = pytest.mark.slow  # starts server processes

TOKEN = "s3cret"
GROUP = 2
MAX_NEW = 6
BATCH = 3
TOK = CharTokenizer("0123456789+-*=() ")
METRICS_PORT = portpicker.pick_unused_port()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    (tmp / "ckpt").mkdir()
    server = ServerProcess(
        tmp,
        [
            f"server.state_dir={tmp / 'state'}",
            f"server.checkpoint_root={tmp / 'ckpt'}",
            f"server.token={TOKEN}",
            "server.slots=4",
            f"rollout.group_size={GROUP}",
            f"rollout.max_new_tokens={MAX_NEW}",
            f"rollout.batch_groups={BATCH}",
            "rollout.max_staleness=1",
            f"server.metrics_port={METRICS_PORT}",
            "server.wait_for_weights=false",  # generate with the random initial weights (v0)
        ],
    )
    server.wait_ready()
    server.tmp = tmp
    yield server
    assert server.stop() == 0, server.log()


def _check_trajectory(t: rollout_pb2.Trajectory, group: rollout_pb2.Group) -> None:
    prompt = list(t.prompt_ids)
    assert prompt == [TOK.bos_id, *TOK.encode(group.prompt_text)]
    n = len(t.completion_ids)
    assert 1 <= n <= MAX_NEW
    assert len(t.behavior_logprobs) == len(t.versions) == n
    assert all(lp <= 0 and np.isfinite(lp) for lp in t.behavior_logprobs)
    assert list(t.versions) == sorted(t.versions)
    eos_at = [i for i, tok in enumerate(t.completion_ids) if tok == TOK.eos_id]
    if t.finish_reason == rollout_pb2.FINISH_REASON_EOS:
        assert eos_at == [n - 1]
    else:
        assert t.finish_reason == rollout_pb2.FINISH_REASON_LENGTH and not eos_at and n == MAX_NEW
    routing = decode_routing(t.routing)
    assert routing.dtype == np.uint8 and t.routing.dtype == "uint8"
    assert routing.shape == (len(prompt) + n, 2, 2)  # tiny: 2 MoE layers, top-2 of 8
    assert routing.max() < 8
    assert (routing[..., 0] != routing[..., 1]).all()
    assert t.reward == float(TOK.decode(t.completion_ids).strip() == group.answer)
    assert t.completion_text == TOK.decode(t.completion_ids)


def test_pull_groups_and_admission(live):
    stub = live.rollout_stub()
    assert stub.Health(rollout_pb2.HealthRequest()).live
    budget = (1 + 0 + 1) * BATCH  # (max_staleness + version + 1) · batch
    wait_for(lambda: stats(stub).groups_queued == budget)
    s = stats(stub)
    assert s.groups_running == 0 and not s.admission_open and s.prompts_drawn == budget
    assert s.prefill_calls == budget  # a group's G samples share one prefill
    groups = _pull_all(stub, budget)
    assert len({g.group_id for g in groups}) == budget
    assert {g.prompt_id for g in groups} == {f"arith-0-{i}" for i in range(budget)}
    for g in groups:
        assert len(g.trajectories) == GROUP
        assert str(eval(g.prompt_text[:-1])) == g.answer
        for t in g.trajectories:
            _check_trajectory(t, g)
            assert set(t.versions) == {0}
    # Pulling alone does not reopen admission: only a new weights version does.
    assert not stub.Pull(rollout_pb2.PullRequest(max_groups=1, timeout_s=1)).groups
    s = stats(stub)
    assert (s.groups_produced, s.groups_consumed, s.groups_running) == (budget, budget, 0)


def test_update_weights_and_versions(live):
    stub = live.rollout_stub()
    path = live.tmp / "ckpt" / "v1"
    save_params(path, random_params("tiny", seed=1))
    bad_token = rollout_pb2.UpdateWeightsRequest(version=1, checkpoint_path=str(path), token="x")
    with pytest.raises(grpc.RpcError) as e:
        rollout_pb2_grpc.RolloutStub(live.raw_channel()).UpdateWeights(bad_token)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    outside = live.tmp / "elsewhere"
    save_params(outside, random_params("tiny", seed=2))
    for bad in [
        str(outside),
        str(live.tmp / "ckpt" / ".." / "elsewhere"),
        "",
        "/etc",
        str(live.tmp / "ckpt" / "missing"),
        str(live.tmp / "ckpt"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(
                rollout_pb2.UpdateWeightsRequest(version=1, checkpoint_path=bad, token=TOKEN)
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    with pytest.raises(grpc.RpcError) as e:  # versions travel as int32 in the engine
        stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(version=2**40, checkpoint_path=str(path), token=TOKEN)
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Health(rollout_pb2.HealthRequest()).version == 0
    reply = stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=1, checkpoint_path=str(path), token=TOKEN)
    )
    assert reply.version == 1
    assert stub.Health(rollout_pb2.HealthRequest()).version == 1
    with pytest.raises(grpc.RpcError) as e:  # older than the current version
        stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(version=0, checkpoint_path=str(path), token=TOKEN)
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    too_many = list(range(4097))  # more rejections than one call may carry: refused
    for call in (
        lambda: stub.Pull(rollout_pb2.PullRequest(max_groups=1, reject_group_ids=too_many)),
        lambda: stub.Ack(rollout_pb2.AckRequest(reject_group_ids=too_many)),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "reject_group_ids" in e.value.details()
    # Groups keep flowing; eventually whole trajectories come from version 1, and within every
    # trajectory versions never decrease.
    seen_v1 = []

    def pull_until_v1():
        request = rollout_pb2.PullRequest(max_groups=8, timeout_s=5, include_texts=True)
        for g in unpacked(stub.Pull(request, timeout=30).groups):
            for t in g.trajectories:
                _check_trajectory(t, g)
                if set(t.versions) == {1}:
                    seen_v1.append(t)
        return seen_v1

    wait_for(pull_until_v1, timeout_s=120, interval_s=0)
    assert "weights swapped: version 0 -> 1" in live.log()


def test_prometheus_metrics(live):
    wait_for(lambda: stats(live.rollout_stub()).groups_produced > 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    produced = [line for line in text.splitlines() if line.startswith("satjax_rollout_groups_")]
    assert any(line.startswith("satjax_rollout_groups_produced ") for line in produced)
    assert "satjax_rollout_prefill_backlog" in text and "satjax_rollout_version" in text
    # The busy-time accounting (loop_stats), through the real engine and driver.
    for name in ("decode_seconds", "decode_steps", "admission_idle_slot_seconds", "cpu_seconds"):
        assert f"satjax_rollout_{name} " in text
    got = stats(live.rollout_stub())
    assert got.decode_steps > 0 and got.decode_seconds > 0 and got.cpu_seconds > 0


def test_stock_jetstream_decode(live):
    stub = jetstream_pb2_grpc.OrchestratorStub(live.channel())
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=10).is_live
    req = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=TOK.encode("12+7=")),
        max_tokens=4,
    )
    ids = [
        i
        for r in stub.Decode(req, timeout=60)
        for s in r.stream_content.samples
        for i in s.token_ids
    ]
    assert 0 <= len(ids) <= 4 and all(3 <= i < TOK.vocab_size for i in ids)
    req = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text="3*4="), max_tokens=3
    )
    text = "".join(s.text for r in stub.Decode(req, timeout=60) for s in r.stream_content.samples)
    assert len(text) <= 3 and set(text) <= set(TOK.alphabet)


INVALID_DECODES = [
    jetstream_pb2.DecodeRequest(max_tokens=3),  # no content
    jetstream_pb2.DecodeRequest(
        session_cache="abc",
        max_tokens=3,
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[4, 5]),
    ),
    jetstream_pb2.DecodeRequest(
        max_tokens=3, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[4] * 40)
    ),  # too long
    jetstream_pb2.DecodeRequest(
        max_tokens=3, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[999])
    ),  # out of vocab
    jetstream_pb2.DecodeRequest(
        max_tokens=3, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[-1])
    ),
    jetstream_pb2.DecodeRequest(
        max_tokens=3, text_content=jetstream_pb2.DecodeRequest.TextContent(text="hello")
    ),  # outside the alphabet
    jetstream_pb2.DecodeRequest(
        max_tokens=0, text_content=jetstream_pb2.DecodeRequest.TextContent(text="1+1=")
    ),
    jetstream_pb2.DecodeRequest(
        max_tokens=10**6, text_content=jetstream_pb2.DecodeRequest.TextContent(text="1+1=")
    ),
    jetstream_pb2.DecodeRequest(
        max_tokens=2,
        session_cache="x",
        text_content=jetstream_pb2.DecodeRequest.TextContent(text=""),
    ),
]


@pytest.mark.parametrize("request_index", range(len(INVALID_DECODES)))
def test_invalid_decode_rejected(live, request_index):
    stub = jetstream_pb2_grpc.OrchestratorStub(live.channel())
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Decode(INVALID_DECODES[request_index], timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=10).is_live


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    max_groups=st.integers(-(2**31), 2**31 - 1),
    timeout_s=st.floats(allow_nan=True, allow_infinity=True, width=32),
    version=st.integers(-(2**63), 2**63 - 1),
    path=st.text(max_size=64),
    token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=48),
    max_tokens=st.integers(-(2**31), 2**31 - 1),
    session=st.text(max_size=8),
)
def test_fuzz_rpcs_keep_server_healthy(
    live, max_groups, timeout_s, version, path, token_ids, max_tokens, session
):
    stub = live.rollout_stub()
    ok_pull = 1 <= max_groups <= 4096 and 0 <= timeout_s <= 600
    try:
        stub.Pull(
            rollout_pb2.PullRequest(
                max_groups=max_groups, timeout_s=min(timeout_s, 0.1) if ok_pull else timeout_s
            ),
            timeout=10,
        )
        assert ok_pull
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and not ok_pull
    with pytest.raises(grpc.RpcError) as e:  # nothing under the root is a checkpoint
        stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(version=version, checkpoint_path=path, token=TOKEN),
            timeout=10,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    decode = jetstream_pb2_grpc.OrchestratorStub(live.channel())
    req = jetstream_pb2.DecodeRequest(
        session_cache=session,
        max_tokens=max_tokens,
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=token_ids),
    )
    valid = (
        not session
        and 1 <= max_tokens <= MAX_NEW
        and len(token_ids) + 1 <= 16
        and all(0 <= i < TOK.vocab_size for i in token_ids)
    )
    try:
        list(decode.Decode(req, timeout=60))
        assert valid
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and not valid, e
    assert stub.Health(rollout_pb2.HealthRequest(), timeout=10).live


# Admission counted from the first trainer weights (a fresh server per test: exact counts).
STALENESS, BATCH_GROUPS = 1, 2
AHEAD = (STALENESS + 1) * BATCH_GROUPS


def _admission_server(server_factory, tmp, *overrides):
    (tmp / "ckpt").mkdir(exist_ok=True)
    return server_factory(
        [
            f"server.checkpoint_root={tmp / 'ckpt'}",
            f"rollout.batch_groups={BATCH_GROUPS}",
            f"rollout.max_staleness={STALENESS}",
            *overrides,
        ]
    )


def _push(stub, tmp, version, *, new_epoch=False):
    path = tmp / "ckpt" / f"v{version}"
    save_params(path, random_params("tiny", seed=version))
    request = rollout_pb2.UpdateWeightsRequest(
        version=version, checkpoint_path=str(path), new_admission_epoch=new_epoch
    )
    assert stub.UpdateWeights(request, timeout=60).version == version


def _settles_at(server, queued, produced, timeout_s=240):
    """Waits until `queued` groups are queued, none running and admission closed; then checks
    that `produced` groups were made in all, not one more. (The first generation compiles: a
    generous timeout.)

    Closed admission with nothing running changes only with a Pull, an Ack or an UpdateWeights,
    so no wait is needed for a wrongly admitted group to show: one started at any earlier time
    is counted here (if it is still running, the wait above times out)."""
    stub = server.rollout_stub()

    def settled():
        s = stats(stub)
        return s.groups_queued == queued and s.groups_running == 0 and not s.admission_open

    try:
        wait_for(settled, timeout_s=timeout_s)
    except AssertionError:
        raise AssertionError(
            f"not settled at {queued}: {stats(stub)}\n{server.log()[-3000:]}"
        ) from None
    s = stats(stub)
    assert s.groups_produced == produced, s


def _min_versions(groups):
    return [min(v for t in g.trajectories for v in t.versions) for g in groups]


def test_waits_for_weights_then_runs_max_staleness_plus_1_batches_ahead(server_factory, tmp_path):
    server = _admission_server(server_factory, tmp_path)
    stub = server.rollout_stub()
    wait_for(lambda: "waiting for the first UpdateWeights" in server.log())
    s = stats(stub)
    assert (s.groups_produced, s.prompts_drawn, s.admission_open) == (0, 0, False)
    _push(stub, tmp_path, 1)
    # (max_staleness + 1)·batch groups of the first weights, and none before them.
    _settles_at(server, AHEAD, produced=AHEAD)
    assert _min_versions(_pull_all(stub, BATCH_GROUPS)) == [1] * BATCH_GROUPS  # one batch trained
    _settles_at(server, AHEAD - BATCH_GROUPS, produced=AHEAD)  # pulling alone admits nothing ...
    _push(stub, tmp_path, 2)
    _settles_at(server, AHEAD, produced=AHEAD + BATCH_GROUPS)  # ... a version, a batch
    # A trainer that (re)connects starts a new epoch: the queued groups no longer count.
    _push(stub, tmp_path, 3, new_epoch=True)
    _settles_at(server, 2 * AHEAD, produced=2 * AHEAD + BATCH_GROUPS)
    got = _min_versions(_pull_all(stub, 2 * AHEAD))
    assert got == [1] * (AHEAD - BATCH_GROUPS) + [2] * BATCH_GROUPS + [3] * AHEAD
    _settles_at(server, 0, produced=2 * AHEAD + BATCH_GROUPS)


def test_groups_of_the_initial_weights_do_not_use_the_budget(server_factory, tmp_path):
    server = _admission_server(server_factory, tmp_path, "server.wait_for_weights=false")
    stub = server.rollout_stub()
    _settles_at(server, AHEAD, produced=AHEAD)  # version 0: the server's random weights
    _push(stub, tmp_path, 1)
    # Still (max_staleness + 1)·batch groups of version 1.
    _settles_at(server, 2 * AHEAD, produced=2 * AHEAD)
    assert _min_versions(_pull_all(stub, 2 * AHEAD)) == [0] * AHEAD + [1] * AHEAD
    _settles_at(server, 0, produced=2 * AHEAD)
