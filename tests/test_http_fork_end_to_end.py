"""Forks from outside (docs/DESIGN.md §6.6): `python -m rollout_server` with
`server.http_session_fork=true` on an HF checkpoint with a real chat template; an agent on the
official `openai` client plays a session, then trims its context to a summary (a fork) and ends
it; the trainer's side pulls the group over gRPC (as `train` does) and finds both segments as
trajectories of their own, the session's reward on each, each segment's log-probs those of a
fresh prefill of its history (transformers over the whole sequence), and a batch that holds
them with the session counted once."""

from __future__ import annotations

import numpy as np
import portpicker
import pytest

from tests import live_http

pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def _pull(port: int):
    from rollout_api import records
    from rollout_api.client import connect
    from rollout_api.proto import rollout_pb2

    channel, stub = connect(f"127.0.0.1:{port}", 64 << 20)
    try:
        for _ in range(60):
            reply = stub.Pull(rollout_pb2.PullRequest(max_groups=1, timeout_s=5), timeout=30)
            if reply.groups:
                (message,) = reply.groups
                stub.Ack(rollout_pb2.AckRequest(group_ids=[message.group_id]), timeout=30)
                return records.decode_group(message)
        raise AssertionError("no group pulled")
    finally:
        channel.close()


def test_a_forking_agent_gives_the_trainer_each_segment_as_a_trajectory(tmp_path):
    import openai
    import torch

    from sat_jax.tasks.hf_tokenizer import HFTokenizer
    from train import batching

    port, http_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    d, proc, log = live_http.serve(tmp_path, port, http_port, "server.http_session_fork=true")
    try:
        url = f"http://127.0.0.1:{http_port}"
        server = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        session = live_http.take(server, proc, tmp_path)
        client = server.with_options(base_url=f"{url}/sessions/{session['session_id']}/v1")
        (model,) = [m.id for m in client.models.list().data]
        first = [{"role": "user", "content": session["prompt"]["text"]}]
        reply = client.chat.completions.create(model=model, messages=first, logprobs=True)
        # The agent summarises its context: a history the session does not hold.
        summary = [{"role": "user", "content": "Earlier I asked a sum. Answer it again."}]
        forked = client.chat.completions.create(model=model, messages=summary, logprobs=True)
        server.post(f"/sessions/{session['session_id']}/end", body={"reward": 0.5}, cast_to=object)
        group = _pull(port)
    finally:
        live_http.stop(proc, log)
    assert "Traceback" not in (tmp_path / "server.log").read_text()
    assert group.sessions == (0, 0) and len(group.trajectories) == 2
    assert [t.reward for t in group.trajectories] == [0.5, 0.5]
    tok = HFTokenizer(str(d.path), chat_template=True, checkpoint=str(d.path))
    for traj, history, choice in zip(
        group.trajectories, (first, summary), (reply, forked), strict=True
    ):
        assert traj.prompt_ids.tolist() == tok.encode_messages(history)  # a fresh prefill
        got = [t.logprob for t in choice.choices[0].logprobs.content]
        np.testing.assert_allclose(traj.behavior_logprobs[traj.generated], got, atol=1e-6)
        ids = [*traj.prompt_ids.tolist(), *traj.completion_ids.tolist()]
        with torch.no_grad():
            logits = d.model(torch.tensor([ids])).logits[0, :, : len(d.tokenizer)].double()
        logp = torch.log_softmax(logits, -1).numpy()
        p = len(traj.prompt_ids)
        want = logp[np.arange(p - 1, len(ids) - 1), traj.completion_ids][traj.generated]
        np.testing.assert_allclose(traj.behavior_logprobs[traj.generated], want, atol=1e-3)
    spec = batching.BatchSpec(
        batch_groups=1,
        group_size=1,
        seq_len=256,
        length_bucket=0,
        routing_lk=None,
        routing_dtype="uint8",
        max_staleness=1 << 30,
        stale_policy="keep",
        vocab_size=len(d.tokenizer),
        num_experts=1 << 30,
    )
    selection = batching.select_groups([group], spec, trainer_version=0, min_version=0)
    batch, stats = batching.assemble_batch(selection, spec, trainer_version=0)
    assert batch.group_ids.tolist() == [0, 0]
    np.testing.assert_allclose(batch.session_weights, [0.5, 0.5])
    assert stats.tokens == sum(t.num_generated for t in group.trajectories)
