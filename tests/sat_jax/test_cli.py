"""sat_jax.cli: the four commands' shared front door: --config and key=value overrides in any
order, a bad key or value as one line naming it on stderr, exit code 2."""

from __future__ import annotations

import pytest

from sat_jax import cli
from sat_jax.experiment import load_config

DOC = """sat-demo: a demo command.

More text that is not the description.
"""


def _exit_line(capsys, fn) -> str:
    with pytest.raises(SystemExit) as exit_info:
        fn()
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    return line


@pytest.mark.parametrize(
    "argv, line",
    [
        (["train.bogus=1"], "sat-demo: config error: train.bogus: unknown key"),
        (["server.port=abc"], "sat-demo: config error: server.port: expected int, got 'abc'"),
        (["rollout.group_size"], "sat-demo: config error: override 'rollout.group_size' is not"),
        (["--config", "nowhere.yaml"], "sat-demo: config error: nowhere.yaml: cannot read"),
        (["model.lora.rank=-1"], "sat-demo: config error: model.lora: lora.rank must be an int"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key_and_exit_2(capsys, argv, line):
    command = cli.Command("sat-demo", DOC)
    got = _exit_line(capsys, lambda: command.load_config(command.parse(argv)))
    assert got.startswith(line), got


def test_a_multi_line_yaml_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: [1,\n")
    command = cli.Command("sat-demo", DOC)
    line = _exit_line(capsys, lambda: command.load_config(command.parse(["--config", str(bad)])))
    assert line.startswith(f"sat-demo: config error: {bad}: not valid YAML")


def test_options_and_overrides_intermix_and_the_command_adds_its_own():
    command = cli.Command("sat-demo", DOC)
    command.parser.add_argument("--out", required=True)
    args = command.parse(["rollout.top_k=5", "--out", "d", "--config", "c.yaml", "name=x"])
    assert (args.config, args.out, args.overrides) == ("c.yaml", "d", ["rollout.top_k=5", "name=x"])
    assert command.parser.description == "sat-demo: a demo command."
    cfg = command.load_config(command.parse(["rollout.top_k=5", "--out", "d"]))
    assert cfg == load_config(None, ["rollout.top_k=5"])
    with pytest.raises(SystemExit) as exit_info:  # argparse's own usage error, also exit 2
        command.parse(["rollout.top_k=5"])
    assert exit_info.value.code == 2


class DemoError(Exception):
    pass


def test_exit_on_turns_the_listed_errors_into_one_line_and_lets_others_through(capsys):
    command = cli.Command("sat-demo", DOC)

    def fails(error: Exception) -> None:
        with command.exit_on(DemoError, OSError):
            raise error

    assert _exit_line(capsys, lambda: fails(DemoError("no\n  checkpoint  in d"))) == (
        "sat-demo: no checkpoint in d"
    )
    line = _exit_line(capsys, lambda: fails(FileNotFoundError(2, "No such file", "x")))
    assert line == "sat-demo: [Errno 2] No such file: 'x'"
    with pytest.raises(KeyError):
        fails(KeyError("a bug is not bad input"))
