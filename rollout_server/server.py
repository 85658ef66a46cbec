"""The `sat-serve` command: `sat-serve --config configs/arith_tiny.yaml server.port=9000` (or
`python -m rollout_server ...`).

The config is read and validated before anything heavy is imported or started: a bad file, key or
value prints one line, `sat-serve: config error: <message naming the key>`, and exits with code 2.
`rollout_server.process` then builds and runs the server; a `state_dir` another server holds
prints one line and exits with code 2, and a failed generation step exits with code 1 once the
state is saved.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from rollout_server.persistence import StateDirLockedError, StateStore
from sat_jax.experiment import ConfigError, load_config


def main(argv: list[str] | None = None) -> None:
    """`sat-serve [--config FILE] [key=value ...]`; a bad config exits with code 2 and one line."""
    parser = argparse.ArgumentParser(prog="sat-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file of overrides (configs/NAME.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"sat-serve: config error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    # JetStream logs every generate step through the root logger at INFO: keep the root at
    # WARNING and our own loggers at INFO.
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("rollout_server").setLevel(logging.INFO)
    try:  # a state_dir another server holds: one line, before anything heavy
        store = StateStore(cfg.server.state_dir)
    except (StateDirLockedError, OSError) as e:
        print(f"sat-serve: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    # Imported only now: JetStream pulls in TensorFlow (seconds, and log lines on stderr), which a
    # config error should not wait for or print.
    from rollout_server import process

    sys.exit(asyncio.run(process.serve(cfg, store)))


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())
