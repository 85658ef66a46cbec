"""The `sat-serve` command: `sat-serve --config configs/arith_tiny.yaml server.port=9000` (or
`python -m rollout_server ...`).

The config is read and validated before anything heavy is imported or started: a bad file, key or
value prints one line, `sat-serve: config error: <message naming the key>`, and exits with code 2.
`rollout_server.process` then builds and runs the server; a `state_dir` another server holds
prints one line and exits with code 2, and a failed generation step exits with code 1 once the
state is saved.
"""

from __future__ import annotations

import asyncio
import sys

from rollout_server.persistence import StateDirLockedError, StateStore
from sat_jax import cli


def main(argv: list[str] | None = None) -> None:
    """`sat-serve [--config FILE] [key=value ...]`; a bad config exits with code 2 and one line."""
    command = cli.Command("sat-serve", __doc__)
    cfg = command.load_config(command.parse(sys.argv[1:] if argv is None else argv))
    cli.log_to_stderr("rollout_server")
    # A state_dir another server holds: one line, before anything heavy.
    with command.exit_on(StateDirLockedError, OSError):
        store = StateStore(cfg.server.state_dir)
    # Imported only now: JetStream pulls in TensorFlow (seconds, and log lines on stderr), which a
    # config error should not wait for or print.
    from rollout_server import process

    sys.exit(asyncio.run(process.serve(cfg, store)))
