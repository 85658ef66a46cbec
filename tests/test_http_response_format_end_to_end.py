"""`response_format` from outside (docs/DESIGN.md §6.6): `python -m rollout_server` on an HF
checkpoint with a real chat template; an agent on the official `openai` client asks a session's
first turn for a json_object and its second for a json_schema, and a stateless request for a
json_schema. The replies are JSON of the format; the trainer's side pulls the session's group
over gRPC (as `train` does), finds each turn's format on the trajectory, replays the masks with
its own tokenizer (`select_groups` keeps the group, `assemble_batch` marks every generated
token as constrained) and, with transformers over the whole sequence renormalized over those
masks, gets the behavior log-probs the server recorded."""

from __future__ import annotations

import json

import numpy as np
import portpicker
import pytest

from tests import live_http
from tests.test_http_fork_end_to_end import _pull

pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"pick": {"enum": ["a", "b", 7]}, "ok": {"type": "boolean"}},
    "required": ["pick", "ok"],
}
TEMPERATURE = 2.5
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def _check_reply(choice, schema: dict) -> bool:
    """A reply that stopped is JSON valid under `schema`; one cut at the token limit (the random
    model may pad with whitespace, which JSON allows anywhere) is the start of one, every token
    of it allowed (the trainer's replay checks that). Returns whether it stopped."""
    if choice.finish_reason == "length":
        assert choice.message.content.startswith("{"), choice
        return False
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)
    return True


def test_json_replies_and_the_trainer_replays_their_masks(tmp_path):
    import openai
    import torch

    from sat_jax.json_mask import parse_response_format
    from sat_jax.model.logprobs import format_allowed
    from sat_jax.tasks import sampleable_mask
    from sat_jax.tasks.hf_tokenizer import HFTokenizer
    from train import batching

    port, http_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    d, proc, log = live_http.serve(
        tmp_path,
        port,
        http_port,
        "model.max_seq_len=512",
        "task.max_episode_tokens=256",
        # The random checkpoint's peaked logits favour whitespace, which JSON allows anywhere:
        # a flatter sampler lets the schema's replies reach their end within the budget.
        f"rollout.temperature={TEMPERATURE}",
        max_new_tokens=100,
    )
    try:
        url = f"http://127.0.0.1:{http_port}"
        server = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        session = live_http.take(server, proc, tmp_path)
        api = server.with_options(base_url=f"{url}/v1")
        (model,) = [m.id for m in api.models.list().data]
        stopped = 0
        for i in range(6):  # until a reply ends by itself; every one that does is valid
            question = [{"role": "user", "content": f"{i}+2?"}]
            r = api.chat.completions.create(
                model=model, messages=question, response_format=JSON_SCHEMA
            )
            stopped += _check_reply(r.choices[0], SCHEMA)
            if stopped:
                break
        assert stopped
        client = server.with_options(base_url=f"{url}/sessions/{session['session_id']}/v1")
        messages = [{"role": "user", "content": session["prompt"]["text"]}]
        first = client.chat.completions.create(
            model=model, messages=messages, response_format={"type": "json_object"}, logprobs=True
        )
        _check_reply(first.choices[0], {"type": "object"})
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Now as the schema says."},
        ]
        second = client.chat.completions.create(
            model=model, messages=messages, response_format=JSON_SCHEMA, logprobs=True
        )
        _check_reply(second.choices[0], SCHEMA)
        server.post(f"/sessions/{session['session_id']}/end", body={"reward": 1.0}, cast_to=object)
        group = _pull(port)
    finally:
        live_http.stop(proc, log)
    assert "Traceback" not in (tmp_path / "server.log").read_text()
    (traj,) = group.trajectories
    formats = (parse_response_format({"type": "json_object"}), parse_response_format(JSON_SCHEMA))
    assert traj.response_formats == formats
    # Every generated token was constrained: the first turn's by format 1, the second's by 2.
    np.testing.assert_array_equal(traj.format_index > 0, traj.generated)
    assert set(traj.format_index[traj.generated].tolist()) == {1, 2}
    tok = HFTokenizer(str(d.path), chat_template=True, checkpoint=str(d.path))
    vocab = d.model.config.vocab_size
    spec = batching.BatchSpec(
        batch_groups=1,
        group_size=1,
        seq_len=400,
        length_bucket=0,
        routing_lk=None,
        routing_dtype="uint8",
        max_staleness=1 << 30,
        stale_policy="keep",
        vocab_size=vocab,
        num_experts=1 << 30,
        tokenizer=tok,
    )
    selection = batching.select_groups([group], spec, trainer_version=0, min_version=0)
    assert len(selection.kept) == 1, selection
    batch, _ = batching.assemble_batch(selection, spec, trainer_version=0)
    ids = [*traj.prompt_ids.tolist(), *traj.completion_ids.tolist()]
    active = np.asarray(batch.loss_mask[0, : len(ids)]) > 0
    assert (np.asarray(batch.format_ids[0, : len(ids)])[active] > 0).all()
    # transformers' log-probs renormalized over the replayed masks are the recorded ones.
    with torch.no_grad():
        logits = d.model(torch.tensor([ids])).logits[0].double().numpy() / TEMPERATURE
    rows = batch.format_ids[:, 1 : len(ids)]
    allowed = np.asarray(format_allowed(batch.format_masks, rows, vocab))[0]
    allowed = allowed & sampleable_mask(tok, vocab)
    z = np.where(allowed, logits[:-1], -np.inf)
    logp = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
    got = np.take_along_axis(logp, np.asarray(ids[1:])[:, None], -1)[:, 0]
    np.testing.assert_allclose(got[active[1:]], traj.behavior_logprobs[traj.generated], atol=1e-3)
    free = logits[:-1] - np.logaddexp.reduce(logits[:-1], axis=-1, keepdims=True)
    free = np.take_along_axis(free, np.asarray(ids[1:])[:, None], -1)[:, 0]
    assert np.abs(free[active[1:]] - traj.behavior_logprobs[traj.generated]).max() > 0.1
