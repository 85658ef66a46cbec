"""`sat-serve` (and `python -m rollout_server`) with a bad config: one line naming the problem on
stderr, exit code 2, and nothing started (no state directory, no "serving on")."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.sat_jax.test_experiment import HF_CONFIG

pytestmark = pytest.mark.slow  # every test starts the server command in a process

REPO = pathlib.Path(__file__).resolve().parents[2]
SAT_SERVE = pathlib.Path(sys.executable).parent / "sat-serve"
COMMANDS = {
    "python -m rollout_server": [sys.executable, "-m", "rollout_server"],
    "sat-serve": [str(SAT_SERVE)],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["server.bogus=1"], "server.bogus: unknown key"),
        (["server.port=abc"], "server.port: expected int, got 'abc'"),
        (
            ["--config", "configs/missing.yaml"],
            "configs/missing.yaml: cannot read the config: No such file or directory",
        ),
        (["server.slots"], "'server.slots' is not key=value"),
    ],
)
def test_config_errors_are_one_line_and_exit_2(tmp_path, command, args, names):
    if command == "sat-serve" and not SAT_SERVE.exists():
        pytest.skip("the sat-serve script is not installed in this environment")
    state = tmp_path / "state"
    out = subprocess.run(
        [*COMMANDS[command], f"server.state_dir={state}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    [line] = out.stderr.splitlines()
    assert line.startswith("sat-serve: config error: ") and names in line, line
    assert not state.exists(), "the server started"


@pytest.mark.parametrize(
    ("files", "args", "names"),
    [
        ({"config.json": '{"model_type": "llama"}'}, [], "model.hf_path: config.json model_type"),
        ({}, [], "model.hf_path: no config.json in"),
        (
            {"config.json": "QWEN", "tokenizer.json": "{}"},
            ["task.chat_template=true"],
            "task.chat_template: the tokenizer in",
        ),
        ({"config.json": "QWEN"}, [], "model.hf_path: no tokenizer files in"),
    ],
)
def test_bad_hf_checkpoints_are_one_line_and_exit_2(tmp_path, files, args, names):
    qwen = json.dumps(dict(HF_CONFIG))
    for name, text in files.items():
        (tmp_path / name).write_text(qwen if text == "QWEN" else text)
    state = tmp_path / "state"
    out = subprocess.run(
        [*COMMANDS["python -m rollout_server"], f"server.state_dir={state}",
         f"model.hf_path={tmp_path}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.splitlines()
    assert line.startswith("sat-serve: config error: ") and names in line, line
    assert not state.exists(), "the server started"
