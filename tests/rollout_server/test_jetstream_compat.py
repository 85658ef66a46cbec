"""rollout_server.jetstream_compat: the three JetStream 0.2.2 fixes its docstring lists."""

import logging
import subprocess
import sys

import jax.numpy as jnp
import pytest

from rollout_server import jetstream_compat


def test_delete_pytree_patched_and_works():
    from jetstream.core import orchestrator

    assert orchestrator.delete_pytree is jetstream_compat.delete_pytree
    tree = {"a": jnp.ones(3), "b": [jnp.zeros(2), 5, None]}
    orchestrator.delete_pytree(tree)
    assert tree["a"].is_deleted() and tree["b"][0].is_deleted()
    orchestrator.delete_pytree(tree)  # deleting twice is harmless


def test_root_logger_not_hijacked():
    root = logging.getLogger()
    assert root.level != logging.DEBUG or not any(
        getattr(h, "stream", None) is sys.stdout for h in root.handlers
    )


def test_real_seqio_untouched_when_installed():
    import importlib.util

    if importlib.util.find_spec("seqio") is None:
        pytest.skip("seqio is not installed here")
    import seqio

    assert not getattr(seqio, "__sat_jax_stand_in__", False)


def test_stand_in_when_seqio_missing():
    # Hide the real seqio: the stand-in must let engine_api import.
    code = (
        "import logging, sys, importlib.util\n"
        "orig = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n.split('.')[0] == 'seqio' else orig(n, *a)\n"
        "class Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'seqio':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Finder())\n"
        "from rollout_server import jetstream_compat\n"
        "from jetstream.engine import engine_api\n"
        "from jetstream.core import orchestrator\n"
        "root = logging.getLogger()\n"
        "assert root.level == logging.WARNING and not root.handlers, (root.level, root.handlers)\n"
        "import seqio\n"
        "assert seqio.__sat_jax_stand_in__\n"
        "try:\n"
        "    seqio.vocabularies.SentencePieceVocabulary('x')\n"
        "except RuntimeError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
