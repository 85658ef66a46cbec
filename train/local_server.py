"""A rollout server child process for single-machine runs (``train.client.servers`` empty).

The child runs ``python -m rollout_server`` with the trainer's own config file and overrides plus a
free port, logs to ``<run_dir>/server.log``, and is asked by the kernel to exit when the trainer
dies (``PR_SET_PDEATHSIG``), so a SIGKILLed trainer leaves no orphan holding the server's state.
Both that and ``stop`` send SIGINT, which stops a server at once (state saved): SIGTERM would start
a drain of ``server.drain_s`` for a trainer that pulls no more, and keep the state directory
locked from a restarted trainer's new child meanwhile.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import grpc

from rollout_api.client import connect
from rollout_api.proto import rollout_pb2

_PR_SET_PDEATHSIG = 1
# The readiness probe only sends Health: gRPC's own 4 MiB message limit is plenty.
_PROBE_MESSAGE_BYTES = 4 * 1024 * 1024

log = logging.getLogger("train")


# Runs in the child before exec'ing the server: a `preexec_fn` would fork a multithreaded (JAX)
# process, which can deadlock. PDEATHSIG survives exec. So does an ignored SIGINT: a trainer
# started in the background by a non-interactive shell (`sat-train ... &`, nohup) inherits SIGINT
# ignored, and so would the server, which then could not be stopped by it before it installs its
# own handler (while it starts); the default disposition is restored first (Python then raises
# KeyboardInterrupt on it, and the server's handler replaces that once it runs).
_EXEC_WITH_PDEATHSIG = f"""
import ctypes, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
try:
    ctypes.CDLL("libc.so.6").prctl({_PR_SET_PDEATHSIG}, signal.SIGINT)
except OSError:
    pass
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """Starts the child; ``wait_ready`` blocks until it answers ``Health``; ``stop`` ends it.

    ``restart_if_exited`` (the pool's retry hook) starts a crashed child again on the same port, at
    most ``max_restarts`` times: the server persists its prompt position, unfinished prompts and
    weights version, so the run continues where it was. ``module``: the server's command
    (``python -m MODULE``; the loop benchmark's stand-in runs ``rollout_server.stand_in``).
    """

    def __init__(
        self,
        config_path: str | None,
        overrides: list[str],
        log_path: str,
        *,
        max_restarts: int = 3,
        module: str = "rollout_server",
    ):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, "-m", module]
        if config_path:
            cmd += ["--config", config_path]
        # The child generates only with the trainer's weights: groups of its random initial
        # weights would be dropped anyway.
        cmd += [
            *overrides,
            "server.host=127.0.0.1",
            f"server.port={self.port}",
            "server.wait_for_weights=true",
        ]
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # one CPU device is enough for the server
        self._cmd, self._env = cmd, env
        self._restarts_left = max_restarts
        self._log = open(log_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def restart_if_exited(self) -> None:
        """Starts the child again if it has exited; raises RuntimeError when out of restarts."""
        if self.proc.poll() is None:
            return
        if self._restarts_left <= 0:
            self.check_alive()
        self._restarts_left -= 1
        log.warning(
            "the local rollout server exited with %s (see %s); restarting it on port %d",
            self.proc.returncode,
            self.log_path,
            self.port,
        )
        self.proc = subprocess.Popen(
            self._cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self._env
        )

    def check_alive(self) -> None:
        """Raises RuntimeError with the log's tail if the child has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"the rollout server exited with {self.proc.returncode}; "
                f"see {self.log_path}:\n{self._tail()}"
            )

    def wait_ready(self, *, timeout_s: float, root_certificates: bytes | None = None) -> None:
        """Raises RuntimeError (with the log's tail) if the child exits or never answers
        (``root_certificates``: the CA when it serves TLS)."""
        channel, stub = connect(
            self.address, _PROBE_MESSAGE_BYTES, root_certificates=root_certificates
        )
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    if stub.Health(rollout_pb2.HealthRequest(), timeout=2.0).live:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        finally:
            channel.close()
        raise RuntimeError(f"the rollout server was not ready after {timeout_s:.0f}s")

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def _tail(self) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-20:])
