"""``train.client.servers_file`` (docs/DESIGN.md §6.5): a file of "host:port" lines (``#``
starts a comment) naming the rollout servers that may join the fleet, re-read every few seconds.
``train.membership.Membership`` adds the new lines' servers and removes those whose lines went;
this module only reads the file: a bad line is skipped, and an unreadable file keeps the servers
it last named, each with one log line until it changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("train")

POLL_S = 3.0  # how often the file is re-read


class ServersFile:
    """The servers file at ``path``, read when due by ``clock`` (see the module docstring)."""

    def __init__(self, path: str, clock: Callable[[], float]):
        self.path = path
        self._clock = clock
        self._read_at: float | None = None
        self._error = ""

    def due(self) -> bool:
        """Whether it was never read, or not for ``POLL_S``."""
        return self._read_at is None or self._clock() - self._read_at >= POLL_S

    def read(self) -> list[str] | None:
        """The "host:port" lines, in order (None: the file cannot be read; keep its servers)."""
        self._read_at = self._clock()
        try:
            with open(self.path) as f:
                lines = [line.split("#", 1)[0].strip() for line in f]
        except OSError as e:
            if str(e) != self._error:
                log.warning("cannot read train.client.servers_file: %s; keeping its servers", e)
                self._error = str(e)
            return None
        self._error = ""
        listed = []
        for line in lines:
            host, sep, port = line.rpartition(":")
            if not line:
                continue
            if not sep or not host or not port.isdigit():
                log.warning("train.client.servers_file %s: %r is not host:port", self.path, line)
                continue
            listed.append(line)
        return listed
