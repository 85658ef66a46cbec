"""Makes google-jetstream 0.2.2 importable and safe on today's jax; import before any `jetstream`.

JetStream 0.2.2 is the last release (the project is archived), so instead of forking it we patch
three things at import time, each idempotent:

1. `jetstream.core.orchestrator.delete_pytree` calls `jax.tree_map`, removed in jax 0.6: the
   generate thread would die on its first insert and JetStream would SIGKILL the process.
2. Importing the orchestrator sets the ROOT logger to DEBUG with a stdout handler, and the
   generate loop logs every step: we restore the logging configuration we had before.
3. `jetstream.engine.engine_api` imports `seqio` (and with it TensorFlow) for a tokenizer our engine
   never uses. Where seqio is absent we register an inert stand-in for `seqio.vocabularies`; where
   the real seqio is installed nothing is replaced.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import jax


def _install_seqio_stand_in() -> None:
    """Registers a minimal `seqio.vocabularies` only when the real seqio cannot be imported."""
    if "seqio" in sys.modules or importlib.util.find_spec("seqio") is not None:
        return
    seqio = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")

    class Vocabulary:
        """Base class JetStream type-annotates against; never instantiated by our engine."""

    class SentencePieceVocabulary(Vocabulary):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("seqio is not installed: SentencePiece tokenizers are unavailable")

    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    seqio.vocabularies = vocabularies
    seqio.Vocabulary = Vocabulary
    seqio.SentencePieceVocabulary = SentencePieceVocabulary
    seqio.__sat_jax_stand_in__ = True
    sys.modules["seqio"] = seqio
    sys.modules["seqio.vocabularies"] = vocabularies


def delete_pytree(tree) -> None:
    """JetStream's `delete_pytree` on `jax.tree_util` (frees every jax.Array leaf now)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def _import_orchestrator_quietly() -> types.ModuleType:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from jetstream.core import orchestrator

    root.setLevel(level)
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    return orchestrator


def apply() -> None:
    """Applies every patch (idempotent; run on import of this module)."""
    _install_seqio_stand_in()
    orchestrator = _import_orchestrator_quietly()
    orchestrator.delete_pytree = delete_pytree


apply()
