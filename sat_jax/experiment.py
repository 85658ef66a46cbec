"""One experiment: the config shared by the rollout server and the trainer, and its loader.

Defaults live only in the section dataclasses (``sat_jax.config``, ``ModelConfig``,
``TaskConfig``, ``PolicyLossConfig``, ``OptimizerConfig``, ``MeshConfig``). A YAML file holds an
experiment's overrides as a nested mapping; ``key=value`` overrides from the command line apply
on top (``sat_jax.config.loader``). ``model.preset`` picks the ``ModelConfig`` preset the other
``model.*`` keys override, or ``model.hf_path`` a checkpoint's config.json. Any unknown key or
bad value raises one ``ConfigError`` naming the dotted key, and a key that moved names its new
place (``MOVED_KEYS``)::

    cfg = load_config("configs/arith_tiny.yaml", ["server.port=9001", "model.preset=small"])
    cfg.train.optimizer.make(cfg.train.steps)    # the optax transformation
    cfg.train.checkpoint                          # -> train.checkpointing.Checkpointer
    cfg.train.client                              # .connection(...) -> train.setup.connect
    cfg.train.step_options(...)                   # the train step's StepConfig (step_config)

The sections nest by concept (docs/DESIGN.md §8): ``model``, ``task``, ``server``, ``rollout`` and
``train`` with ``train.optimizer``, ``train.checkpoint``, ``train.warmup``, ``train.client``,
``train.eval`` and ``train.loss``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from sat_jax.config import ConfigError, RolloutConfig, ServerConfig, TrainConfig, build
from sat_jax.config.loader import coerce, read_overrides
from sat_jax.model import hf
from sat_jax.model.config import PRESETS, RUNTIME_FIELDS, LoRAConfig, ModelConfig
from sat_jax.tasks import tokenizers
from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.tokenizer import CharTokenizer, Tokenizer

__all__ = ["MOVED_KEYS", "ConfigError", "ExperimentConfig", "load_config", "make_tokenizer"]

# Keys that moved when the trainer's flat keys were nested by concept: each fails with one line
# naming its new place (the loader also maps everything under a moved prefix).
MOVED_KEYS = types.MappingProxyType(
    {
        "train.learning_rate": "train.optimizer.learning_rate",
        "train.lr_schedule": "train.optimizer.lr_schedule",
        "train.lr_warmup_steps": "train.optimizer.lr_warmup_steps",
        "train.adam_b1": "train.optimizer.adam_b1",
        "train.adam_b2": "train.optimizer.adam_b2",
        "train.weight_decay": "train.optimizer.weight_decay",
        "train.grad_clip": "train.optimizer.grad_clip",
        "train.checkpoint_dir": "train.checkpoint.dir",
        "train.checkpoint_every": "train.checkpoint.every",
        "train.keep_checkpoints": "train.checkpoint.keep",
        "train.warmup_sft_steps": "train.warmup.steps",
        "train.sft_batch": "train.warmup.batch",
        "train.sft_learning_rate": "train.warmup.learning_rate",
        "train.sft_cache_dir": "train.warmup.cache_dir",
        "train.servers": "train.client.servers",
        "train.servers_file": "train.client.servers_file",
        "train.pull_timeout_s": "train.client.pull_timeout_s",
        "train.retry_max_s": "train.client.retry_max_s",
        "train.server_wait_s": "train.client.wait_s",
        "train.server_grace_s": "train.client.grace_s",
        "train.eval_problems": "train.eval.problems",
        "train.eval_every": "train.eval.every",
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """One experiment: model, task, rollout server and sampling, and the trainer."""

    name: str = "experiment"
    model: ModelConfig = PRESETS["tiny"]
    task: TaskConfig = TaskConfig()
    server: ServerConfig = ServerConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self) -> None:
        self._check_schedule()
        self._check_lengths()
        self._check_task()

    def _check_schedule(self) -> None:
        """The trainer's schedule against the server's admission and the batch."""
        if self.train.mode == "sync" and self.rollout.max_staleness != 0:
            raise ValueError("train.mode 'sync' needs rollout.max_staleness = 0")
        if self.train.weight_sync_interval > self.rollout.max_staleness + 1:
            # The server admits at most max_staleness + 1 batches past its weights version: a
            # longer push interval would starve the trainer.
            raise ValueError(
                "train.weight_sync_interval must be <= rollout.max_staleness + 1 "
                f"({self.train.weight_sync_interval} > {self.rollout.max_staleness} + 1)"
            )
        batch = self.rollout.batch_groups * self.rollout.group_size
        if batch % self.train.microbatches:
            raise ValueError(
                f"train.microbatches ({self.train.microbatches}) must divide the batch "
                f"(rollout.batch_groups · rollout.group_size = {batch})"
            )

    def _check_lengths(self) -> None:
        """Prompt, completion and episode lengths against the model's."""
        if self.server.max_prefill_length + self.rollout.max_new_tokens > self.model.max_seq_len:
            raise ValueError(
                f"server.max_prefill_length + rollout.max_new_tokens "
                f"({self.server.max_prefill_length} + {self.rollout.max_new_tokens}) exceeds "
                f"model.max_seq_len ({self.model.max_seq_len})"
            )
        if self.task.multi_turn or self.server.http_sessions:
            episode = self.completion_tokens
            if self.server.max_prefill_length + episode > self.model.max_seq_len:
                raise ValueError(
                    f"server.max_prefill_length + task.max_episode_tokens "
                    f"({self.server.max_prefill_length} + {episode}) exceeds model.max_seq_len "
                    f"({self.model.max_seq_len})"
                )
            if episode < self.rollout.max_new_tokens:
                raise ValueError(
                    f"task.max_episode_tokens ({episode}) must be >= rollout.max_new_tokens "
                    f"({self.rollout.max_new_tokens}), which bounds each turn"
                )
        row = self.train.row_tokens
        longest = self.server.max_prefill_length + self.completion_tokens
        if self.train.packing and row and longest > row:
            key = (
                "rollout.max_new_tokens"
                if self.completion_tokens == self.rollout.max_new_tokens
                else "task.max_episode_tokens"
            )
            raise ValueError(
                f"a trajectory may hold server.max_prefill_length + {key} "
                f"({self.server.max_prefill_length} + {self.completion_tokens}) tokens, more "
                f"than train.row_tokens ({row}): a packed row must hold the longest trajectory "
                "(it is never split); raise train.row_tokens or lower the lengths"
            )
        budget = self.train.microbatch_tokens
        if budget and not self.train.packing:
            raise ValueError("train.microbatch_tokens needs train.packing (rows of tokens)")
        if budget and self.train.microbatches != 1:
            raise ValueError(
                "train.microbatch_tokens chooses each batch's microbatches: set "
                f"train.microbatches to 1, not {self.train.microbatches}"
            )
        if budget and budget < (row or longest):
            raise ValueError(
                f"train.microbatch_tokens ({budget}) must hold one packed row: >= "
                f"train.row_tokens ({row or longest})"
            )
        if (
            self.train.overlong == "soft"
            and self.train.overlong_cache > self.rollout.max_new_tokens
        ):
            raise ValueError(
                f"train.overlong_cache ({self.train.overlong_cache}) must be <= "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) for train.overlong 'soft'"
            )

    def _check_task(self) -> None:
        """The warm-up, the evaluation and the tokenizer against the task and the model."""
        if self.model.hf_path and self.train.warmup.steps:
            raise ValueError(
                "train.warmup.steps: the supervised warm-up is for the arithmetic demo; "
                "with model.hf_path the starting weights are the checkpoint's (set 0)"
            )
        if self.train.eval.problems and self.task.source != "arithmetic":
            raise ValueError(
                f"train.eval.problems: the trainer's held-out evaluation draws generated "
                f"arithmetic problems, and task.source is {self.task.source!r}; set 0 and "
                "evaluate checkpoints with sat-eval --problems N"
            )
        if self.tokenizer_kind == "char":
            needed = CharTokenizer(self.task.alphabet).vocab_size
            if needed > self.model.vocab_size:
                raise ValueError(
                    f"task.alphabet needs {needed} token ids, model.vocab_size is "
                    f"{self.model.vocab_size}"
                )
            if self.task.chat_template:
                raise ValueError("task.chat_template needs task.tokenizer 'hf'")
        elif not self.tokenizer_path:
            raise ValueError("task.tokenizer 'hf' needs task.tokenizer_path or model.hf_path")
        if self.server.http_sessions and not self.task.chat_template:
            raise ValueError("server.http_sessions needs task.chat_template: true")
        for i in self.rollout.stop_token_ids:
            if i >= self.model.vocab_size:
                raise ValueError(
                    f"rollout.stop_token_ids: {i} is outside model.vocab_size "
                    f"({self.model.vocab_size})"
                )

    @property
    def tokenizer_kind(self) -> str:
        """``task.tokenizer``, or its default: "hf" when ``model.hf_path`` is set, else "char"."""
        return tokenizers.tokenizer_kind(self.task, hf_path=self.model.hf_path)

    @property
    def tokenizer_path(self) -> str:
        """The HF tokenizer's directory: ``task.tokenizer_path``, else ``model.hf_path``."""
        return tokenizers.tokenizer_path(self.task, hf_path=self.model.hf_path)

    @property
    def completion_tokens(self) -> int:
        """The most completion tokens of one trajectory: `rollout.max_new_tokens` single-turn;
        for a multi-turn `task.env`, the episode's generated and inserted tokens together,
        `task.max_episode_tokens` (0 = what `model.max_seq_len` leaves after
        `server.max_prefill_length`). The server's per-slot decode budget and the trainer's
        capacity (prompt + completion) follow it. HTTP sessions (`server.http_sessions`) are
        multi-turn episodes too."""
        if not (self.task.multi_turn or self.server.http_sessions):
            return self.rollout.max_new_tokens
        return self.task.max_episode_tokens or (
            self.model.max_seq_len - self.server.max_prefill_length
        )

    @property
    def serving_model(self) -> ModelConfig:
        """The model config the rollout server runs: `server.dtype` as its parameter dtype, and
        no LoRA adapters (the server serves base + scale·A·B merged into the weights)."""
        model = self.model
        if model.lora.rank:
            model = model.replace(lora=LoRAConfig())
        if not self.server.dtype:
            return model
        return model.replace(param_dtype=jnp.dtype(self.server.dtype))


def load_config(path: str | None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Builds an ``ExperimentConfig`` from a YAML overrides file and ``key=value`` overrides.

    Raises:
      ConfigError: naming the dotted key of the first moved, unknown or invalid key.
    """
    flat = read_overrides(path, overrides)
    cfg = build(ExperimentConfig, flat, moved=MOVED_KEYS, bases={"model": _model_base})
    try:
        tokenizers.check_tokenizer(cfg.task, hf_path=cfg.model.hf_path)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return cfg


def _model_base(section: Mapping[str, Any]) -> tuple[ModelConfig, frozenset[str]]:
    """The ModelConfig that ``model.*`` keys override: ``model.hf_path``'s config.json when set
    (where only the runtime fields may differ from it), else ``model.preset`` (default "tiny")."""
    hf_path = section.get("hf_path")
    if not hf_path:
        preset = section.get("preset", "tiny")
        if preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset {preset!r}; known: {sorted(PRESETS)}")
        return PRESETS[preset], frozenset({"preset"})
    if "preset" in section:
        raise ConfigError("model.preset: cannot be combined with model.hf_path")
    try:
        base = hf.config_from_dir(str(hf_path))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.hf_path: {e}") from e
    hints = typing.get_type_hints(ModelConfig)
    for key, raw in section.items():
        name = key.split(".")[0]
        if name in RUNTIME_FIELDS or name == "hf_path" or "." in key or name not in hints:
            continue
        value = coerce(raw, hints[name], f"model.{name}")
        if value != getattr(base, name):
            raise ConfigError(
                f"model.{name}: {value!r} contradicts {base.hf_path}/config.json "
                f"({getattr(base, name)!r}); with model.hf_path only {', '.join(RUNTIME_FIELDS)} "
                "may be set"
            )
    return base, frozenset()


def make_tokenizer(cfg: ExperimentConfig) -> Tokenizer:
    """The tokenizer ``cfg`` names (``sat_jax.tasks.tokenizers.make_task_tokenizer``):
    ``task.tokenizer`` over ``task.alphabet`` or from ``task.tokenizer_path`` (default
    ``model.hf_path``), with ``rollout.stop_token_ids`` as extra stops."""
    return tokenizers.make_task_tokenizer(
        cfg.task, hf_path=cfg.model.hf_path, stop_ids=cfg.rollout.stop_token_ids
    )
