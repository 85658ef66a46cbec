"""Trainer checkpoints with orbax: the sharded ``TrainState`` plus a JSON record of the loop.

A checkpoint holds two items: ``state`` (params, optimizer state, step; restored straight into the
shardings of ``train_state_shardings``) and ``progress`` (weight version, PRNG key, counters and the
ids of recently trained prompts). The directory may be local or ``gs://``; orbax writes each step
to a temporary name and renames (or commits) it when complete, so a kill mid-save leaves the
previous checkpoint as the latest. Only the newest ``keep`` checkpoints are kept.

Server weights (what ``UpdateWeights`` loads) are a separate, simpler format: the params alone,
written with ``sat_jax.params_io.save_params``. Both share ``params_io.ORBAX_LOCK``: one orbax
operation at a time in the process.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from sat_jax import params_io
from sat_jax.experiment import CheckpointConfig
from sat_jax.model import ModelConfig
from sat_jax.parallel import sharding
from sat_jax.train_step import TrainState, train_state_shardings

# Prompt ids remembered for de-duplication after a restart (bounded: memory stays flat).
RECENT_PROMPTS = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress:
    """The loop's state besides the ``TrainState`` (JSON-able).

    Attributes:
      version: version of the weights in the saved params.
      min_version: the first version this run published; older tokens are never trained.
      rng_key: ``jax.random.key_data`` of the loop's PRNG key.
      groups_trained, tokens_trained, stale_dropped, steps_skipped: running totals.
      recent_prompt_ids: the last ``RECENT_PROMPTS`` trained prompt ids, oldest first.
      recent_group_keys: the last ``RECENT_PROMPTS`` trained groups' ``Group.key``s
        (a server re-delivers a group whose acknowledgement a crash lost: it is skipped).
    """

    version: int
    min_version: int
    rng_key: tuple[int, ...]
    groups_trained: int = 0
    tokens_trained: int = 0
    stale_dropped: int = 0
    steps_skipped: int = 0
    recent_prompt_ids: tuple[str, ...] = ()
    recent_group_keys: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (tuples as lists)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Progress:
        """The inverse of `to_json`."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()})


def abstract_train_state(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """``ShapeDtypeStruct``s of a ``TrainState`` carrying their target shardings (nothing
    allocated)."""
    _, abstract_params = sharding.abstract_model(model_cfg)
    shapes = jax.eval_shape(
        lambda p: TrainState(
            params=p, opt_state=optimizer.init(p), step=jax.numpy.zeros((), "int32")
        ),
        nnx.to_pure_dict(abstract_params),
    )
    shardings = train_state_shardings(model_cfg, optimizer, mesh)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


class CheckpointNotFound(ValueError):
    """No checkpoint directory, no checkpoint in it, or not the requested step."""


def restore_params(
    directory: str,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    step: int | None = None,
) -> tuple[int, Any]:
    """The params of checkpoint ``step`` (default the latest) in ``directory``, in their
    shardings on ``mesh``; returns ``(step, params)``.

    Raises:
      CheckpointNotFound: one line naming the directory (and the steps there).
    """
    if "://" not in directory and not os.path.isdir(directory):
        raise CheckpointNotFound(f"no checkpoint directory {directory}")
    with Checkpointer(directory, keep=2**31 - 1) as ckpt:  # read-only: nothing saved or pruned
        steps = ckpt.all_steps()
        if not steps:
            raise CheckpointNotFound(f"no checkpoint in {directory}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise CheckpointNotFound(f"no checkpoint {step} in {directory} (have {steps})")
        state, _ = ckpt.restore(step, abstract_train_state(model_cfg, optimizer, mesh))
    return step, state.params


class Checkpointer:
    """An orbax ``CheckpointManager`` for (``TrainState``, ``Progress``), keep-N, synchronous saves.

    Args:
      directory: a local path or a ``gs://`` URL.
      keep: how many checkpoints to keep.
    """

    def __init__(self, directory: str, *, keep: int):
        self._manager = ocp.CheckpointManager(
            params_io.absolute(directory),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=False, create=True
            ),
            item_names=("state", "progress"),
        )

    @classmethod
    def from_config(cls, cfg: CheckpointConfig, run_dir: str) -> Checkpointer:
        """The checkpoints ``cfg`` configures (``cfg.train.checkpoints``): in
        ``cfg.directory(run_dir)``, keeping ``cfg.keep_checkpoints``."""
        return cls(cfg.directory(run_dir), keep=cfg.keep_checkpoints)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints kept, oldest first."""
        return list(self._manager.all_steps())

    def save(self, step: int, state: TrainState, progress: Progress) -> None:
        """Writes checkpoint ``step`` (atomically; a no-op when ``step`` already exists)."""
        if step in self._manager.all_steps():
            return
        with params_io.ORBAX_LOCK:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    progress=ocp.args.JsonSave(progress.to_json()),
                ),
            )
            self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, Progress]:
        """Reads checkpoint ``step`` into the shardings ``abstract_state`` carries."""
        with params_io.ORBAX_LOCK:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    progress=ocp.args.JsonRestore(),
                ),
            )
        return out["state"], Progress.from_json(out["progress"])

    def close(self) -> None:
        """Closes the orbax manager."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
