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

from tests import hf_fixtures

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
           f"train.run_dir={run_dir}", "train.eval_problems=0", "rollout.batch_groups=1",
           "rollout.group_size=2", "rollout.max_new_tokens=8", "task.max_episode_tokens=32",
           "server.max_prefill_length=128", "model.max_seq_len=256", f"server.http_port={port}",
           "train.server_wait_s=300"]  # fmt: skip
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
