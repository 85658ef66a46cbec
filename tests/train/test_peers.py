"""``train.peers.PeerWatch`` without JAX: three watchers in this process over a dict standing in
for the coordination service's key-value store. A watcher that says goodbye is no loss; one whose
connections close without it is named by every other one, once."""

from __future__ import annotations

import threading

import pytest

from tests.clock import wait_until
from train.peers import PeerWatch


class FakeStore:
    """``key_value_set`` / ``blocking_key_value_get`` over a dict."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.cond = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000), key
            return self.values[key]


def _watchers(n: int) -> tuple[list[PeerWatch], list[list[str]]]:
    store, lost = FakeStore(), [[] for _ in range(n)]
    watchers = [
        PeerWatch(store, i, n, host_ip="127.0.0.1", timeout_s=60, on_lost=lost[i].append)
        for i in range(n)
    ]
    threads = [threading.Thread(target=w.start) for w in watchers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return watchers, lost


def test_a_goodbye_is_no_loss():
    watchers, lost = _watchers(3)
    for w in watchers:
        w.close(goodbye=True)
    assert lost == [[], [], []]


@pytest.mark.parametrize("gone", [0, 2])
def test_a_process_gone_without_a_goodbye_is_named_by_every_other(gone):
    watchers, lost = _watchers(3)
    watchers[gone].close(goodbye=False)  # its sockets close, as a killed process's do
    others = [i for i in range(3) if i != gone]
    wait_until(lambda: all(lost[i] for i in others), timeout_s=60)
    for i in others:
        [message] = lost[i]
        assert message.startswith(f"trainer process {gone} of 3 (host ")
        assert f"connection to process {i} closed without a goodbye" in message
        assert watchers[i].lost.is_set()
    assert lost[gone] == []
    for i in others:
        watchers[i].close(goodbye=True)
