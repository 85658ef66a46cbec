"""Trainer checkpoints with orbax: the sharded ``TrainState`` plus a JSON record of the loop.

A checkpoint holds two items: ``state`` (params, optimizer state, step; restored straight into the
shardings of ``train_state_shardings``) and ``progress`` (weight version, PRNG key, counters and the
ids of recently trained prompts).

With LoRA (``model.lora.rank`` > 0) ``state`` holds only the adapters, their optimizer state and
the step, never the frozen base (``TrainState.frozen``, which can be tens of GB): a restore
rebuilds the base the way the run first made it (``train.setup.base_policy``: the HF checkpoint,
or the seeded init and the cached warm-up) and joins it to the restored adapters
(``restore_train_state``, ``restore_params``). Adapters trained on another base would be
silently wrong, so ``progress`` records a fingerprint of the base (``base_fingerprint``: one
32-bit hash of every leaf's bits, computed on device, exact whatever the sharding) and a restore
onto a base that does not match refuses, naming the leaves that differ (``BaseMismatch``). The directory may be local or ``gs://``; orbax writes each step
to a temporary name and renames (or commits) it when complete, so a kill mid-save leaves the
previous checkpoint as the latest. Only the newest ``keep`` checkpoints are kept. Saves write in
the background while training goes on (``Checkpointer``).

Server weights (what ``UpdateWeights`` loads) are a separate, simpler format: the params alone,
written with ``sat_jax.params_io.save_weights`` (flat) or ``save_shards`` (several processes),
which take no orbax lock; only weights written to a URL (orbax's ``save_params``) share
``params_io.ORBAX_LOCK`` with the checkpoints: one orbax operation at a time in the process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from sat_jax import params_io
from sat_jax.config import CheckpointConfig
from sat_jax.model import ModelConfig
from sat_jax.model.lora import split_lora
from sat_jax.step import TrainState
from sat_jax.step import state as train_state

log = logging.getLogger("train")

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
      base_fingerprint: with LoRA, ``base_fingerprint`` of the frozen base the adapters were
        trained on (``{}`` without LoRA).
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
    base_fingerprint: dict[str, str] = dataclasses.field(default_factory=dict)

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
    """What a checkpoint holds, as ``ShapeDtypeStruct``s carrying their target shardings (nothing
    allocated): ``sat_jax.step.abstract_train_state`` without the frozen base."""
    return train_state.abstract_train_state(model_cfg, optimizer, mesh).replace(frozen=None)


class CheckpointNotFound(ValueError):
    """No checkpoint directory, no checkpoint in it, or not the requested step."""


class BaseMismatch(ValueError):
    """A LoRA checkpoint restored onto a base other than the one its adapters were trained on."""


def _bits_hash(x: jax.Array) -> jax.Array:
    """A uint32 hash of an array's bits and their positions (fmix32 of each element's bits and
    flat index, summed mod 2^32: integer sums do not depend on the reduction order, so the hash is
    the same on any mesh)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = min(x.dtype.itemsize, 4)
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * width}")).astype(jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)
    for dim, size in enumerate(bits.shape):
        index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim)
    h = bits ^ (index * jnp.uint32(0x9E3779B9))
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return jnp.sum(h ^ (h >> 16), dtype=jnp.uint32)


_jit_bits_hash = jax.jit(_bits_hash)


def base_fingerprint(base: Any) -> dict[str, str]:
    """``{"layers/0/attn/w_q_dnh": "float32[32,4,8]:1a2b3c4d", ...}`` of a params tree: each leaf's
    dtype, shape and a 32-bit hash of its bits, computed on its devices (only the hashes reach
    the host). Two trees with equal fingerprints are, but for a hash collision, equal."""
    leaves = jax.tree_util.tree_leaves_with_path(base)
    hashes = jax.device_get([_jit_bits_hash(x) for _, x in leaves])
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): (
            f"{jnp.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]:{int(h):08x}"
        )
        for (path, x), h in zip(leaves, hashes, strict=True)
    }


def check_base(recorded: dict[str, str], base: Any, *, where: str) -> None:
    """Raises ``BaseMismatch`` unless ``base``'s fingerprint is ``recorded``.

    Args:
      recorded: ``Progress.base_fingerprint`` of the checkpoint.
      base: the rebuilt frozen base.
      where: names the checkpoint in the message.
    """
    if not recorded:
        raise BaseMismatch(
            f"{where} records no base fingerprint: it is not a LoRA checkpoint (model.lora.rank "
            "> 0 needs a checkpoint saved with LoRA on)"
        )
    got = base_fingerprint(base)
    if got == recorded:
        return
    differ = [k for k in recorded if k in got and got[k] != recorded[k]]
    lines = [f"{k} (saved {recorded[k]}, now {got[k]})" for k in differ[:3]]
    lines += [f"{k} missing now" for k in recorded if k not in got][:3]
    lines += [f"{k} not in the saved base" for k in got if k not in recorded][:3]
    raise BaseMismatch(
        f"{where}: the base model differs from the one its LoRA adapters were trained on "
        f"({len(differ)} of {len(recorded)} tensors differ: {'; '.join(lines)}). A LoRA "
        "checkpoint holds only the adapters; restore it with the run's base (the same "
        "model.hf_path, or train.seed, warm-up and train.warmup.cache_dir)"
    )


def restore_train_state(
    ckpt: Checkpointer,
    step: int,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    base: Any = None,
) -> tuple[TrainState, Progress]:
    """Checkpoint ``step`` as a whole ``TrainState`` in its shardings on ``mesh``.

    Args:
      ckpt: the checkpoints.
      step: which one.
      model_cfg, optimizer, mesh: what the state was made with.
      base: with LoRA, the whole model's params whose non-adapter leaves are the frozen base
        (e.g. ``train.setup.base_policy``'s; its adapters are ignored); unused without LoRA.

    Raises:
      BaseMismatch: with LoRA, ``base`` is not the base the checkpoint was trained on.
      ValueError: LoRA is on and no ``base`` was given.
    """
    state, progress = ckpt.restore(step, abstract_train_state(model_cfg, optimizer, mesh))
    if not model_cfg.lora.rank:
        return state, progress
    if base is None:
        raise ValueError("restoring a LoRA checkpoint needs the base params (base=...)")
    shardings = train_state.train_state_shardings(model_cfg, optimizer, mesh)
    frozen = jax.device_put(split_lora(base)[0], shardings.frozen)
    check_base(progress.base_fingerprint, frozen, where=f"checkpoint {step}")
    return state.replace(frozen=frozen), progress


def restore_params(
    directory: str,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    step: int | None = None,
    base: Callable[[], Any] | None = None,
) -> tuple[int, Any]:
    """The whole model's params of checkpoint ``step`` (default the latest) in ``directory``, in
    their shardings on ``mesh``; returns ``(step, params)``.

    Args:
      directory, model_cfg, optimizer, mesh: the checkpoints and what they were made with.
      step: which one; default the latest.
      base: with LoRA, called once the checkpoint is found: the whole model's params whose
        non-adapter leaves are the run's base (``train.setup.base_policy``'s); the result joins
        them with the checkpoint's adapters.

    Raises:
      CheckpointNotFound: one line naming the directory (and the steps there).
      BaseMismatch: with LoRA, ``base()`` is not the base the checkpoint was trained on.
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
        whole = base() if model_cfg.lora.rank and base is not None else None
        state, _ = restore_train_state(ckpt, step, model_cfg, optimizer, mesh, whole)
    return step, state.model_params


class Checkpointer:
    """An orbax ``CheckpointManager`` for (``TrainState``, ``Progress``), keep-N, saves in the
    background (docs/DESIGN.md §7.3).

    ``save`` returns once the state's arrays are copied off the devices (orbax's blocking part),
    so the next step may donate them; the write and its commit go on in the background while the
    loop trains. At most one save is in flight: a save first waits for the one before it. The
    process's other orbax operations (weight pushes to a URL) wait for an in-flight save to commit
    (``params_io.ORBAX_LOCK`` is held from a save's start to its commit), since orbax's completion
    signalling is not safe across concurrent operations. A save that fails, at its start or in
    the background, is logged with its directory and step and does not stop the run: the next
    scheduled save writes a new checkpoint, and a failed write never touches the checkpoints
    already committed (orbax writes each step under a temporary name and commits it when whole).
    ``close`` (and leaving the ``with`` block) waits for the last save.

    Args:
      directory: a local path or a ``gs://`` URL.
      keep: how many checkpoints to keep.
      background: write in the background (False = ``save`` returns once the checkpoint is
        committed, as a synchronous save).
    """

    def __init__(self, directory: str, *, keep: int, background: bool = True):
        self.directory = directory
        self._manager = ocp.CheckpointManager(
            params_io.absolute(directory),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=background, create=True
            ),
            item_names=("state", "progress"),
        )
        self._background = background
        self._in_flight: threading.Thread | None = None
        self.failures = 0  # saves that failed (logged), for the run's metrics and tests

    @classmethod
    def from_config(cls, cfg: CheckpointConfig, run_dir: str) -> Checkpointer:
        """The checkpoints ``cfg`` configures (``cfg.train.checkpoint``): in
        ``cfg.directory(run_dir)``, keeping ``cfg.keep``."""
        return cls(cfg.directory(run_dir), keep=cfg.keep)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (after any save in flight)."""
        self.wait()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints kept, oldest first (after any save in flight)."""
        self.wait()
        return list(self._manager.all_steps())

    def save(self, step: int, state: TrainState, progress: Progress) -> bool:
        """Starts checkpoint ``step`` of ``state`` (a no-op when ``step`` already exists) and
        returns once its arrays are off the devices; the write commits in the background. With
        LoRA the frozen base is left out and its fingerprint goes into ``progress`` (computed
        here unless ``progress`` already has it).

        Returns:
          False when the save could not start (logged; the run goes on), else True.
        """
        if step in self.all_steps():  # waits for the save in flight: at most one
            return True
        if state.frozen is not None:
            if not progress.base_fingerprint:
                fingerprint = base_fingerprint(state.frozen)
                progress = dataclasses.replace(progress, base_fingerprint=fingerprint)
            state = state.replace(frozen=None)
        params_io.ORBAX_LOCK.acquire()
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    progress=ocp.args.JsonSave(progress.to_json()),
                ),
            )
        except Exception as e:  # disk full, permissions, a bad URL: the run goes on
            params_io.ORBAX_LOCK.release()
            self._failed(step, e)
            return False
        self._in_flight = threading.Thread(
            target=self._commit, args=(step,), name=f"checkpoint-{step}", daemon=True
        )
        self._in_flight.start()
        if not self._background:
            self.wait()
        return True

    def _commit(self, step: int) -> None:
        """Waits for orbax's background write of ``step`` to commit, then frees the orbax lock."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._failed(step, e)
        finally:
            params_io.ORBAX_LOCK.release()

    def _failed(self, step: int, error: BaseException) -> None:
        self.failures += 1
        log.error(
            "checkpoint %d in %s failed (%s: %s); training goes on, the next checkpoint is a "
            "new attempt and the committed ones are untouched",
            step,
            self.directory,
            type(error).__name__,
            error,
        )

    def wait(self) -> None:
        """Returns once no save is in flight (the last one committed or failed)."""
        if self._in_flight is not None:
            self._in_flight.join()
            self._in_flight = None

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, Progress]:
        """Reads checkpoint ``step`` into the shardings ``abstract_state`` carries (with LoRA
        without the frozen base: ``abstract_train_state``; ``restore_train_state`` joins it)."""
        self.wait()
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
        """Waits for the save in flight, then closes the orbax manager."""
        self.wait()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
