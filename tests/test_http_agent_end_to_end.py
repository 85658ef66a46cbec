"""The example agent trains: `sat-train --config configs/http_agent_gsm8k.yaml` (its local server
child with the HTTP endpoint and sessions on) and examples/http_agent's workers, on the official
`openai` client only, playing the admitted sessions; the trainer finishes its step on their
groups (README "Agents over HTTP")."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading

import portpicker
import pytest

from tests import hf_fixtures, live_http

pytest.importorskip("openai")
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_example_agent_trains(tmp_path):
    from examples.http_agent import calculator_agent

    d = hf_fixtures.make_hf_dir(tmp_path / "hf", problems=8)
    port = portpicker.pick_unused_port()
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "train", "--config", str(REPO / "configs/http_agent_gsm8k.yaml"),
           f"model.hf_path={d.path}", f"task.path={d.data}", "train.steps=1",
           f"train.run_dir={run_dir}", "train.eval.problems=0", "rollout.batch_groups=1",
           "rollout.group_size=2", "rollout.max_new_tokens=8", "task.max_episode_tokens=32",
           "server.max_prefill_length=128", "model.max_seq_len=256", f"server.http_port={port}",
           "train.client.wait_s=300"]  # fmt: skip
    stop, done = threading.Event(), []
    workers = [
        threading.Thread(
            target=_keep_playing,
            args=(calculator_agent, f"http://127.0.0.1:{port}", stop, done),
            daemon=True,
        )
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    try:
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    out = proc.stdout + proc.stderr
    server_log = (run_dir / "server.log").read_text()
    assert proc.returncode == 0, out + server_log
    assert "done: 1 steps" in out, out
    assert "Traceback" not in server_log, server_log
    assert len(done) >= 2


def _keep_playing(agent, url, stop, done):
    """The example's worker, started again while the server is not up yet."""
    import openai

    while not stop.is_set():
        try:
            agent.worker(url, "", stop, done)
        except openai.APIConnectionError:
            stop.wait(1.0)


def test_http_session_logprobs_match_transformers(tmp_path):
    """From outside: `python -m rollout_server` on an unseen HF checkpoint with a real chat
    template; a two-turn session through the official client; every generated token's log-prob
    the client got equals transformers' over the whole conversation (prompt, turns, delta)."""
    import openai
    import torch

    from sat_jax.tasks.hf_tokenizer import HFTokenizer

    port, http_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    d, proc, log = live_http.serve(tmp_path, port, http_port, max_new_tokens=8)
    try:
        url = f"http://127.0.0.1:{http_port}"
        server = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        session = live_http.take(server, proc, tmp_path)
        client = server.with_options(base_url=f"{url}/sessions/{session['session_id']}/v1")
        messages = [{"role": "user", "content": session["prompt"]["text"]}]
        (model,) = [m.id for m in client.models.list().data]  # the one served model's name
        first = client.chat.completions.create(model=model, messages=messages, logprobs=True)
        messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
        second = client.chat.completions.create(model=model, messages=messages, logprobs=True)
    finally:
        live_http.stop(proc, log)
    tok = HFTokenizer(str(d.path), chat_template=True, checkpoint=str(d.path))
    prompt = tok.encode_messages(messages[:1])
    turn1 = [t.token_id for t in first.choices[0].logprobs.content]
    turn2 = [t.token_id for t in second.choices[0].logprobs.content]
    closed = first.choices[0].finish_reason == "stop" and tok.closes_turn(turn1[-1])
    delta = tok.observation_ids(messages[-1:], close_turn=not closed)
    ids = prompt + turn1 + delta + turn2
    with torch.no_grad():
        logits = d.model(torch.tensor([ids])).logits[0, :, : len(d.tokenizer)].double()
    logp = torch.log_softmax(logits, -1)
    starts = (len(prompt), len(prompt) + len(turn1) + len(delta))
    for start, choice in zip(starts, (first, second), strict=True):
        for k, t in enumerate(choice.choices[0].logprobs.content):
            want = float(logp[start + k - 1, t.token_id])
            assert abs(t.logprob - want) < 1e-3, (start + k, t.logprob, want)
