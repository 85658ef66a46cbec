"""A live `sat-serve` for end-to-end HTTP tests: `python -m rollout_server` with
configs/http_agent_gsm8k.yaml (HTTP endpoint and sessions on) on a tiny local HF checkpoint, on
free loopback ports; nothing is downloaded.

    d, proc, log = serve(tmp_path, port, http_port, "server.http_sampling=override")
    try:
        session = take(server, proc, tmp_path)   # `server`: an openai.OpenAI at the HTTP port
    finally:
        stop(proc, log)
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading

from tests import hf_fixtures

REPO = pathlib.Path(__file__).resolve().parents[1]


def serve(tmp_path, port: int, http_port: int, *overrides: str, max_new_tokens: int = 6):
    """Starts the server (gRPC on `port`, HTTP on `http_port`, `overrides` last); returns the
    checkpoint (`hf_fixtures.HFDir`), the process and its open log file (tmp_path/server.log)."""
    d = hf_fixtures.make_hf_dir(tmp_path / "hf", problems=4)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "rollout_server", "--config",
           str(REPO / "configs/http_agent_gsm8k.yaml"), f"model.hf_path={d.path}",
           f"task.path={d.data}", "rollout.batch_groups=1", "rollout.group_size=1",
           f"rollout.max_new_tokens={max_new_tokens}", "task.max_episode_tokens=32",
           "server.max_prefill_length=128", "model.max_seq_len=256", "server.dtype=float32",
           "server.wait_for_weights=false", f"server.port={port}",
           f"server.http_port={http_port}", f"server.state_dir={tmp_path / 'state'}",
           *overrides]  # fmt: skip
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    return d, proc, log


def take(server, proc, tmp_path) -> dict:
    """One session taken with the official client (`POST /sessions`), waiting while the server
    starts; fails with the server's log if it died."""
    import openai

    for _ in range(300):
        try:
            body = {"max_sessions": 1, "timeout_s": 5}
            taken = server.post("/sessions", body=body, cast_to=object)["sessions"]
        except openai.APIConnectionError:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            threading.Event().wait(1.0)
            continue
        if taken:
            return taken[0]
    raise AssertionError("no session offered")


def stop(proc, log) -> None:
    """SIGINT (stops at once, state saved; SIGTERM would drain first), then closes the log."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
