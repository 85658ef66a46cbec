"""The command line the four commands share (`sat-serve`, `sat-train`, `sat-eval`, `sat-export`):
`--config FILE`, dotted `key=value` overrides, and bad input as one line on stderr with exit code
2 (docs/DESIGN.md §8).

    command = cli.Command("sat-export", __doc__)
    command.parser.add_argument("--out", required=True, help="output directory (new or empty)")
    args = command.parse(sys.argv[1:] if argv is None else argv)  # the entry point reads argv
    with command.exit_on(ConfigError, ExportError, OSError):  # "sat-export: <message>", exit 2
        cfg = load_config(args.config, args.overrides)
        ...

Each command adds only its own arguments to `command.parser`. Options and overrides may come in
any order (`sat-export k=v --out DIR k=v`). `Command.load_config` is the config step of the
long-running commands (`sat-serve`, `sat-train`): a `ConfigError` prints
`<prog>: config error: <the message naming the key>`. Every message is collapsed to one line.
Only the commands' entry points use this module, and they hand it their arguments: nothing here
reads `sys.argv` or the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import NoReturn

from sat_jax.experiment import ConfigError, ExperimentConfig, load_config

# The exit status of every refused input (a bad config, argument or file), as argparse's own.
EXIT_BAD_INPUT = 2


def one_line(message: object) -> str:
    """`message` as text on one line (runs of whitespace, newlines included, become one space)."""
    return " ".join(str(message).split())


class Command:
    """One command's parser and its one-line failures.

    Args:
      prog: the command's name (`sat-train`), the prefix of its error lines.
      doc: its module docstring; the first line is the `--help` description.

    Attributes:
      parser: the `argparse` parser, holding `--config` and the positional `overrides`; the
        command adds its own arguments to it.
    """

    def __init__(self, prog: str, doc: str | None):
        self.prog = prog
        description = doc.splitlines()[0] if doc else None  # None under `python -OO`
        self.parser = argparse.ArgumentParser(prog=prog, description=description)
        self.parser.add_argument("--config", help="YAML file of overrides (configs/NAME.yaml)")
        self.parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        """The parsed arguments of `argv` (the entry point's `sys.argv[1:]`); options and
        overrides may be intermixed. A malformed command line exits with argparse's usage line
        and code 2."""
        return self.parser.parse_intermixed_args(list(argv))

    def fail(self, message: object) -> NoReturn:
        """Prints `<prog>: <message>` on one line to stderr and exits with code 2."""
        print(f"{self.prog}: {one_line(message)}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)

    @contextlib.contextmanager
    def exit_on(self, *errors: type[Exception], prefix: str = "") -> Iterator[None]:
        """Turns `errors` raised in the block into `fail(prefix + message)`."""
        try:
            yield
        except errors as e:
            self.fail(f"{prefix}{e}")

    def load_config(self, args: argparse.Namespace) -> ExperimentConfig:
        """The experiment config of `--config` and the overrides; a `ConfigError` fails with
        `<prog>: config error: <message naming the key>`."""
        with self.exit_on(ConfigError, prefix="config error: "):
            return load_config(args.config, args.overrides)


def log_to_stderr(*loggers: str) -> None:
    """Logs to stderr with timestamps: the root logger at WARNING (JetStream logs every generate
    step through it at INFO) and the named `loggers` (the command's own) at INFO."""
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for name in loggers:
        logging.getLogger(name).setLevel(logging.INFO)
