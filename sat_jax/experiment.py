"""The experiment config shared by the rollout server and the trainer, and its loader.

Defaults live only in the dataclasses below. A YAML file holds an experiment's overrides as a nested
mapping; `key=value` overrides from the command line apply on top of it, with dotted keys
(`rollout.group_size=8`) and values parsed by `yaml.safe_load`. `model.preset` picks the
`ModelConfig` preset the other `model.*` keys override. Any unknown key or bad value raises one
`ConfigError` naming the dotted key.

    cfg = load_config("configs/arith_tiny.yaml", ["server.port=9001", "model.preset=small"])

Parts (docs/DESIGN.md §8). The keys stay flat (`train.learning_rate`, `train.servers`,
`train.checkpoint_every`, ...): they are the fields of `TrainConfig`, with its defaults. What a
builder needs is a typed part made from the fields of the same names, never the whole config:

    cfg.train.optimizer.make()         # OptimizerConfig -> the optax transformation
    cfg.train.warmup                   # WarmupConfig -> train.warmup.run (runs or loads it)
    cfg.train.checkpoints              # CheckpointConfig -> train.checkpointing.Checkpointer
    cfg.client.connection_args()       # ClientConfig (train.servers, ..., server.token)
                                       #   -> the keyword arguments of train.remote.ServerPool

A part holds no defaults (its fields are required) and checks its own fields; `TrainConfig` checks
the rest and builds its parts in `__post_init__`, so a bad key still names itself
(`train: learning_rate must be > 0, ...`). The trainer's objects (the warm-up, the checkpointer,
the server pool) are built in `train/` from the part alone: `sat_jax` imports no trainer code.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import yaml

from sat_jax.model import hf
from sat_jax.model.config import PRESETS, RUNTIME_FIELDS, LoRAConfig, ModelConfig
from sat_jax.objectives import PolicyLossConfig, SATConfig
from sat_jax.optimizer import OptimizerConfig
from sat_jax.parallel.sharding import MeshConfig
from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.tokenizer import CharTokenizer, Tokenizer

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
# Frozen defaults of TrainConfig (shared instances are safe: the dataclasses are immutable).
_SAT_LOSS = PolicyLossConfig(sat=SATConfig(enabled=True))
_ONE_AXIS_MESH = MeshConfig()
_ONE_DEVICE_MESH = MeshConfig(fsdp=1)


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the dotted key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The rollout server process.

    Attributes:
      host: bind address; anything but loopback requires `token`.
      port: gRPC port for JetStream's Orchestrator and our Rollout service.
      metrics_port: Prometheus port; 0 disables it.
      metrics_host: the Prometheus port's bind address (loopback unless set otherwise).
      token: shared secret every RPC but Health must carry as gRPC metadata
        `authorization: Bearer <token>` ("" = none, loopback only; docs/DESIGN.md §10).
      checkpoint_root: `UpdateWeights` loads checkpoints only under this directory ("" refuses
        every path).
      state_dir: where prompt position and unpulled prompts persist ("" = no persistence).
      wait_for_weights: generate nothing until the first `UpdateWeights` (or weights restored
        from `state_dir`); False = also sample with the server's own random initial weights as
        version 0 (a stand-alone demo; a trainer drops those groups).
      slots: concurrent decodes (the decode batch).
      max_prefill_length: longest prompt in tokens (as the tokenizer encodes it); a power of two
        in [16, 32768] (JetStream). Longer prompts are skipped and counted.
      max_message_bytes: gRPC message size limit of replies (a Pull's groups).
      max_request_bytes: the largest request the server reads (its gRPC receive limit); the
        largest legitimate one (a Decode prompt, a Pull's acknowledgements) is well under 1 MiB.
      grpc_threads: threads that wait for and hand out groups (Pull); UpdateWeights has its own.
      max_concurrent_rpcs: RPCs served at once; more are refused with RESOURCE_EXHAUSTED.
      lease_s: a pulled group not acknowledged within this many seconds returns to the queue.
      max_version_jump: UpdateWeights may raise the weights version by at most this much.
      seed: sampling PRNG seed.
      tls_cert, tls_key: PEM files; when both are set the gRPC port serves TLS only.
      dtype: storage dtype of the served weights ("" = `model.param_dtype`); pushed weights are
        cast to it, e.g. float32 trainer weights served in bfloat16 (docs/DESIGN.md §11).
      mesh: the engine's device mesh, the trainer's `MeshConfig` and logical-axis rules (params
        by the rules, the KV cache's heads over `tensor`); the default is one device, and a -1
        axis takes every device (docs/DESIGN.md §12).
      http_port: the OpenAI-compatible HTTP endpoint's port on `host` (0 = off): chat and
        completions on the rollouts' engine, with `token` as its bearer token (docs/DESIGN.md
        §6.6).
      http_sessions: admitted samples are played by external agents as HTTP sessions instead of
        in-server episodes (needs `http_port` and `task.chat_template`).
      http_max_body_bytes, http_max_messages: the largest request body and the most messages
        of a chat request.
      http_max_sessions: sessions taken and not ended at once (more are refused with 429).
      http_max_requests: requests without a session generating at once (more get 429).
      http_session_idle_s: a taken session with no request for this long is dropped and its
        sample generated again.
    """

    host: str = "127.0.0.1"
    port: int = 9000
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    token: str = ""
    checkpoint_root: str = ""
    state_dir: str = ""
    wait_for_weights: bool = True
    slots: int = 8
    max_prefill_length: int = 32
    max_message_bytes: int = 256 * 1024 * 1024
    max_request_bytes: int = 4 * 1024 * 1024
    grpc_threads: int = 8
    max_concurrent_rpcs: int = 64
    lease_s: float = 300.0
    max_version_jump: int = 1_000_000
    seed: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    dtype: str = ""
    mesh: MeshConfig = _ONE_DEVICE_MESH
    http_port: int = 0
    http_sessions: bool = False
    http_max_body_bytes: int = 1024 * 1024
    http_max_messages: int = 256
    http_max_sessions: int = 256
    http_max_requests: int = 64
    http_session_idle_s: float = 600.0

    def __post_init__(self) -> None:
        self._check_http()
        if self.dtype:
            _check_float_dtype(self.dtype)
        if self.host not in _LOOPBACK_HOSTS and not self.token:
            raise ValueError(f"host {self.host!r} is not loopback: a token is required")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("slots", "grpc_threads", "max_concurrent_rpcs", "max_version_jump"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        n = self.max_prefill_length
        if n < 16 or n > 32768 or n & (n - 1):
            raise ValueError(f"max_prefill_length must be a power of two in [16, 32768], got {n}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be set together")
        if self.max_message_bytes < 1024 * 1024:
            raise ValueError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")
        if self.max_request_bytes < 64 * 1024:
            raise ValueError(f"max_request_bytes must be >= 64 KiB, got {self.max_request_bytes}")

    def _check_http(self) -> None:
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port {self.http_port} is the gRPC port")
        if self.http_sessions and not self.http_port:
            raise ValueError("http_sessions needs an http_port")
        if self.http_max_body_bytes < 1024:
            raise ValueError(f"http_max_body_bytes must be >= 1024, got {self.http_max_body_bytes}")
        for name in ("http_max_messages", "http_max_sessions", "http_max_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.http_session_idle_s > 0:
            raise ValueError(f"http_session_idle_s must be > 0, got {self.http_session_idle_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How completions are sampled and how far generation may run ahead of training.

    Attributes:
      group_size: G samples per prompt.
      max_new_tokens: completion length limit (EOS included).
      temperature, top_p, top_k: the sampler; top_p = 1 and top_k = 0 disable truncation.
      logprob_replay: how the trainer scores a token sampled under top-k / top-p truncation:
        "truncated" (the default) renormalises over the trainer's own top-n tokens, n the
        sampler's kept-set size recorded per token, so that at lag 0 the trainer's log-prob is
        the behavior log-prob; "full" over the whole vocabulary (the truncation then reads as a
        mismatch). Without truncation both are the same.
      batch_groups: groups per trainer step (the `batch` of docs/DESIGN.md §6's admission rule).
      max_staleness: versions a group may lag; admission keeps
        (max_staleness + version + 1)·batch_groups − (consumed + queued + running) > 0, counted
        from the server's first trainer weights (so (max_staleness + 1)·batch_groups groups of
        them, then batch_groups more per version).
      queue_groups: capacity of the finished-group queue.
      stop_token_ids: ids that end a completion besides the tokenizer's eos ids (an HF
        checkpoint's eos set comes from its config.json and generation_config.json).
    """

    group_size: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    logprob_replay: str = "truncated"
    batch_groups: int = 8
    max_staleness: int = 1
    queue_groups: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(i < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        for name in ("group_size", "max_new_tokens", "batch_groups", "queue_groups"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_staleness < 0:
            raise ValueError("top_k and max_staleness must be >= 0")
        if self.logprob_replay not in ("truncated", "full"):
            raise ValueError(
                f"logprob_replay must be 'truncated' or 'full', got {self.logprob_replay!r}"
            )

    @property
    def replays_truncation(self) -> bool:
        """Whether trajectories carry kept counts the trainer replays: the sampler truncates
        (top_k > 0 or top_p < 1) and `logprob_replay` is "truncated"."""
        return (self.top_k > 0 or self.top_p < 1.0) and self.logprob_replay == "truncated"


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """The supervised warm-up before RL (`train.warmup.run` runs it, or loads it from its cache).

    No defaults: `TrainConfig.warmup` builds it from the `train.*` fields of the same names.

    Attributes:
      warmup_sft_steps: supervised steps on the task (0 = no warm-up).
      sft_batch, sft_learning_rate: the warm-up's batch size and Adam rate.
      sft_cache_dir: where results are cached, one directory per warm-up setting.
      seed: `train.seed`, the seed of the initial params the warm-up starts from (part of the
        cache key).
    """

    warmup_sft_steps: int
    sft_batch: int
    sft_learning_rate: float
    sft_cache_dir: str
    seed: int

    def __post_init__(self) -> None:
        if self.warmup_sft_steps < 0:
            raise ValueError(f"warmup_sft_steps must be >= 0, got {self.warmup_sft_steps}")
        if self.sft_batch <= 0:
            raise ValueError(f"sft_batch must be positive, got {self.sft_batch}")
        if not self.sft_learning_rate > 0:
            raise ValueError(f"sft_learning_rate must be > 0, got {self.sft_learning_rate}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The trainer's checkpoints (`train.checkpointing.Checkpointer.from_config` opens them).

    No defaults: `TrainConfig.checkpoints` builds it from the `train.*` fields of the same names.

    Attributes:
      checkpoint_dir: a local path or a URL such as "gs://bucket/path"; "" = under the run
        directory (`directory`).
      checkpoint_every: save every k updates (and at the end).
      keep_checkpoints: how many checkpoints to keep.
    """

    checkpoint_dir: str
    checkpoint_every: int
    keep_checkpoints: int

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def directory(self, run_dir: str) -> str:
        """`checkpoint_dir`, or `<run_dir>/checkpoints` when it is empty."""
        return self.checkpoint_dir or os.path.join(run_dir, "checkpoints")


class ConnectionArgs(typing.TypedDict):
    """The keyword arguments of `train.remote.ServerPool` that the config decides."""

    token: str
    root_certificates: bytes | None
    max_message_bytes: int
    retry_max_s: float
    server_wait_s: float
    grace_s: float
    servers_file: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """How the trainer reaches its rollout servers: `train.servers`, `train.servers_file`,
    `train.tls_ca`, `train.retry_max_s`, `train.server_wait_s`, `train.server_grace_s`,
    `train.pull_timeout_s`, and the servers' own
    `server.token` and `server.max_message_bytes`.

    No defaults and no checks of its own: `ExperimentConfig.client` builds it from the fields of
    the same names, checked where they are keys (`TrainConfig`, `ServerConfig`).
    """

    servers: tuple[str, ...]
    servers_file: str
    tls_ca: str
    retry_max_s: float
    server_wait_s: float
    server_grace_s: float
    pull_timeout_s: float
    token: str
    max_message_bytes: int

    def root_certificates(self) -> bytes | None:
        """The PEM certificates of `tls_ca`, or None when it is "" (plaintext).

        Raises:
          OSError: the file cannot be read.
        """
        if not self.tls_ca:
            return None
        with open(self.tls_ca, "rb") as f:
            return f.read()

    def connection_args(self) -> ConnectionArgs:
        """`ServerPool`'s connection arguments (the addresses, run id and retry hook come from
        the run): `ServerPool(addresses, run_id=..., **client.connection_args())`."""
        return ConnectionArgs(
            token=self.token,
            root_certificates=self.root_certificates(),
            max_message_bytes=self.max_message_bytes,
            retry_max_s=self.retry_max_s,
            server_wait_s=self.server_wait_s,
            grace_s=self.server_grace_s,
            servers_file=self.servers_file,
        )


_Part = typing.TypeVar("_Part")


def _part(cls: type[_Part], *sections: Any) -> _Part:
    """`cls` built from its fields' namesakes in `sections` (the first section that has each)."""
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        section = next(s for s in sections if field.name in s.__dataclass_fields__)
        values[field.name] = getattr(section, field.name)
    return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The trainer (docs/DESIGN.md §7): servers, schedule, optimizer, staleness policy, checkpoints.

    The batch (`rollout.batch_groups` groups of `rollout.group_size`) and the staleness bound
    (`rollout.max_staleness`) are shared with the server's admission rule and live in `rollout`.
    The fields are the `train.*` keys; the builders take parts made from them (`optimizer`,
    `warmup`, `checkpoints`; and `ExperimentConfig.client`), see the module docstring.

    Attributes:
      servers: rollout server addresses ("host:port"); empty = start one local server process
        with this experiment's config (its `server.checkpoint_root` and `server.state_dir`
        default to `run_dir` and "<run_dir>/server").
      mode: "async" (generation keeps running while the trainer steps) or "sync" (generation
        waits for the new weights: needs `rollout.max_staleness = 0` and
        `weight_sync_interval = 1`, so every trained token has lag 0).
      steps: RL updates to apply (skipped steps do not count).
      weight_sync_interval: n, push weights to the servers every n updates (the configured lag).
      stale_policy: what happens to a group with a token older than `rollout.max_staleness`
        versions: "drop" (counted in `stale_dropped`) or "keep" (trained, still counted).
      routing_replay: replay the rollout's recorded expert ids in the train step (R3).
      microbatches: k, the batch is split into k microbatches whose gradients are accumulated
        (docs/DESIGN.md §5): loss, gradient and metrics equal the one-pass step's; the batch size
        must be divisible by k. SAT's threshold scope is `loss.sat.threshold_scope`.
      length_bucket: a batch's time axis is padded to the smallest of `length_bucket` · 2^k
        (k ≥ 0) and the capacity (`server.max_prefill_length` + `rollout.max_new_tokens`) that
        holds its longest row, so the step compiles once per bucket (docs/DESIGN.md §7.1);
        0 = always the capacity.
      loss: the policy objective; SAT on by default.
      old_logp: the proximal log-probs of the objective: "behavior" (the sampler's, the
        default) or "recompute" (the current params' own before the update, AReaL's decoupled
        objective: TIS, IcePop and the sequence corrections then weigh behavior → proximal;
        docs/DESIGN.md §3.4).
      advantage_estimator, normalize_std: GRPO ("grpo", optional std division) or "dr_grpo".
      filter_groups: DAPO's dynamic sampling: "none", or "all_equal": a pulled group whose
        trajectories' raw rewards (before overlong shaping) are all exactly equal (zero
        advantage) is not trained but rejected to its server, which generates a replacement,
        and the trainer pulls on (metric `groups_filtered`).
      filter_max_rounds: at most `filter_max_rounds` · `rollout.batch_groups` groups are
        filtered while filling one batch; past that the rest of the batch is filled without the
        filter, with a warning (>= 1).
      overlong: a truncated trajectory (finish reason "length"): "none"; "mask" (its loss mask
        is 0; its reward still counts in its group's baseline); or "soft" (DAPO's soft overlong
        punishment, with L_max = `rollout.max_new_tokens`, L_cache = `overlong_cache`, added to
        every trajectory's reward: 0 up to L_max − L_cache tokens, then
        `overlong_penalty` · ((L_max − L_cache) − length) / L_cache). Metric `overlong_frac`.
      overlong_cache: L_cache; "soft" needs 0 < overlong_cache <= `rollout.max_new_tokens`.
      overlong_penalty: the soft punishment's factor (>= 0): it ranges over [−penalty, 0].
      learning_rate, lr_schedule, lr_warmup_steps: peak rate, "constant" | "cosine" | "linear"
        decay to 0 over `steps`, and linear warm-up steps (part `optimizer`).
      adam_b1, adam_b2, weight_decay, grad_clip: AdamW and global-norm clipping (0 = off)
        (part `optimizer`).
      mesh: the device mesh of the train step.
      run_dir: logs, checkpoints, plots and weights for the server; a local directory (the
        server loads weights from it); "" = "runs/<name>".
      checkpoint_dir: orbax checkpoints, a local path or a URL such as "gs://bucket/path" (passed
        to orbax unchanged: etils epath with GCS credentials); "" = "<run_dir>/checkpoints"
        (part `checkpoints`).
      checkpoint_every: save a full checkpoint every k updates (and at the end) (part
        `checkpoints`).
      keep_checkpoints: how many checkpoints to keep (part `checkpoints`).
      warmup_sft_steps: supervised warm-up steps on the task before RL (0 = none); the result is
        cached under `sft_cache_dir` (part `warmup`).
      sft_cache_dir: where warm-up results are cached, one directory per warm-up setting.
      sft_batch, sft_learning_rate: the warm-up's batch size and Adam rate.
      eval_problems: held-out problems for greedy exact-match accuracy (0 = no evaluation).
      eval_every: evaluate every k updates during RL (0 = only before and after).
      pull_timeout_s: how long one Pull waits for groups (part `ExperimentConfig.client`).
      retry_max_s: the longest backoff between retries while a server is down.
      server_wait_s: give up when no server answered, or none sent a group, for this long.
      server_grace_s: a server whose calls keep failing this long leaves the pull rotation and
        the push set (the run goes on with the others); it is probed and rejoins when it answers.
      servers_file: a file of "host:port" lines, re-read every few seconds: new lines join the
        fleet, removed ones leave ("" = none; with `servers` empty and this set, no local server).
      tls_ca: PEM file of the CA (or self-signed certificate) to verify the servers with; set,
        the trainer connects over TLS ("" = plaintext).
      seed: the trainer's PRNG seed (the initial params, hence also part `warmup`).
      wandb: also log to Weights & Biases (needs the `wandb` package).
    """

    servers: tuple[str, ...] = ()
    mode: str = "async"
    steps: int = 100
    weight_sync_interval: int = 1
    stale_policy: str = "drop"
    routing_replay: bool = True
    microbatches: int = 1
    length_bucket: int = 64
    loss: PolicyLossConfig = _SAT_LOSS
    old_logp: str = "behavior"
    advantage_estimator: str = "grpo"
    normalize_std: bool = True
    filter_groups: str = "none"
    filter_max_rounds: int = 4
    overlong: str = "none"
    overlong_cache: int = 0
    overlong_penalty: float = 1.0
    learning_rate: float = 1e-4
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mesh: MeshConfig = _ONE_AXIS_MESH
    run_dir: str = ""
    checkpoint_dir: str = ""
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    warmup_sft_steps: int = 0
    sft_cache_dir: str = "runs/sft_cache"
    sft_batch: int = 64
    sft_learning_rate: float = 3e-3
    eval_problems: int = 200
    eval_every: int = 0
    pull_timeout_s: float = 30.0
    retry_max_s: float = 10.0
    server_wait_s: float = 600.0
    server_grace_s: float = 5.0
    servers_file: str = ""
    tls_ca: str = ""
    seed: int = 0
    wandb: bool = False

    def __post_init__(self) -> None:
        choices = {
            "mode": ("async", "sync"),
            "stale_policy": ("drop", "keep"),
            "advantage_estimator": ("grpo", "dr_grpo"),
            "old_logp": ("behavior", "recompute"),
            "filter_groups": ("none", "all_equal"),
            "overlong": ("none", "mask", "soft"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("weight_sync_interval", "microbatches", "filter_max_rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("eval_problems", "eval_every", "length_bucket", "overlong_cache"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.overlong_penalty < float("inf"):
            raise ValueError(
                f"overlong_penalty must be finite and >= 0, got {self.overlong_penalty}"
            )
        if self.overlong == "soft" and self.overlong_cache == 0:
            raise ValueError("overlong 'soft' needs overlong_cache > 0")
        if self.server_grace_s < 0:
            raise ValueError(f"server_grace_s must be >= 0, got {self.server_grace_s}")
        for name in ("pull_timeout_s", "retry_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for address in self.servers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"servers: {address!r} is not host:port")
        if "://" in self.run_dir:
            raise ValueError(
                f"run_dir must be a local directory, got {self.run_dir!r}; put checkpoints on a "
                "URL with checkpoint_dir"
            )
        if self.mode == "sync" and self.weight_sync_interval != 1:
            raise ValueError("mode 'sync' needs weight_sync_interval = 1")
        self._check_old_logp()
        # Each part checks its own fields: building them checks the rest of the keys.
        _ = (self.optimizer, self.warmup, self.checkpoints)

    def _check_old_logp(self) -> None:
        """The loss options that need proximal log-probs need "recompute", and the clip-based
        ones do nothing with it (one update per batch: r = π/π_old is 1 at the update)."""
        loss = self.loss
        needs = [
            name
            for name in ("tis_cap", "icepop_range", "seq_tis_cap", "seq_mask_range")
            if getattr(loss, name, None) is not None
        ]
        if needs and self.old_logp != "recompute":
            raise ValueError(
                f"loss.{needs[0]} weighs behavior → proximal log-probs: it needs "
                "old_logp 'recompute' (with 'behavior' the weight would always be 1)"
            )
        if self.old_logp == "recompute":
            inert = [
                name
                for name, on in (
                    ("loss.sat.enabled", loss.sat.enabled),
                    ("loss.dppo_tv_delta", loss.dppo_tv_delta is not None),
                    ("loss.dual_clip", loss.dual_clip is not None),
                )
                if on
            ]
            if inert:
                raise ValueError(
                    f"old_logp 'recompute' with {inert[0]}: the step applies one update per "
                    "batch, so the ratio to the recomputed proximal policy is 1 at the update "
                    "and the clip (SAT's contraction, DPPO-TV, dual-clip) never acts; use "
                    "old_logp 'behavior' with it, or drop it (docs/DESIGN.md §3.4)"
                )

    @property
    def optimizer(self) -> OptimizerConfig:
        """The optimizer part; `.make()` is the optax transformation the trainer steps with."""
        return _part(OptimizerConfig, self)

    @property
    def warmup(self) -> WarmupConfig:
        """The supervised warm-up part (`train.warmup.run` runs or loads it)."""
        return _part(WarmupConfig, self)

    @property
    def checkpoints(self) -> CheckpointConfig:
        """The checkpoint part (`train.checkpointing.Checkpointer.from_config` opens them)."""
        return _part(CheckpointConfig, self)


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
        if self.train.mode == "sync" and self.rollout.max_staleness != 0:
            raise ValueError("train.mode 'sync' needs rollout.max_staleness = 0")
        if self.train.weight_sync_interval > self.rollout.max_staleness + 1:
            # The server admits at most max_staleness + 1 batches past its weights version: a
            # longer push interval would starve the trainer.
            raise ValueError(
                "train.weight_sync_interval must be <= rollout.max_staleness + 1 "
                f"({self.train.weight_sync_interval} > {self.rollout.max_staleness} + 1)"
            )
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
        if (
            self.train.overlong == "soft"
            and self.train.overlong_cache > self.rollout.max_new_tokens
        ):
            raise ValueError(
                f"train.overlong_cache ({self.train.overlong_cache}) must be <= "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) for train.overlong 'soft'"
            )
        batch = self.rollout.batch_groups * self.rollout.group_size
        if batch % self.train.microbatches:
            raise ValueError(
                f"train.microbatches ({self.train.microbatches}) must divide the batch "
                f"(rollout.batch_groups · rollout.group_size = {batch})"
            )
        if self.model.hf_path and self.train.warmup_sft_steps:
            raise ValueError(
                "train.warmup_sft_steps: the supervised warm-up is for the arithmetic demo; "
                "with model.hf_path the starting weights are the checkpoint's (set 0)"
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
        for i in self.rollout.stop_token_ids:
            if i >= self.model.vocab_size:
                raise ValueError(
                    f"rollout.stop_token_ids: {i} is outside model.vocab_size "
                    f"({self.model.vocab_size})"
                )

    @property
    def tokenizer_kind(self) -> str:
        """`task.tokenizer`, or its default: "hf" when `model.hf_path` is set, else "char"."""
        return self.task.tokenizer or ("hf" if self.model.hf_path else "char")

    @property
    def tokenizer_path(self) -> str:
        """The HF tokenizer's directory: `task.tokenizer_path`, else `model.hf_path`."""
        return self.task.tokenizer_path or self.model.hf_path

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
    def client(self) -> ClientConfig:
        """The trainer's connection to its servers: `train.servers`, `train.tls_ca`, the retry and
        wait times, and `server.token` and `server.max_message_bytes`."""
        return _part(ClientConfig, self.train, self.server)

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


def _check_float_dtype(name: str) -> None:
    try:
        dtype = jnp.dtype(name)
    except TypeError as e:
        raise ValueError(f"dtype {name!r} is not a dtype") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Builds an `ExperimentConfig` from a YAML overrides file and `key=value` overrides.

    Raises:
      ConfigError: naming the dotted key of the first unknown key or invalid value.
    """
    flat: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                doc = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from e
        if doc is not None and not isinstance(doc, Mapping):
            raise ConfigError(f"{path}: the top level must be a mapping")
        _flatten(doc or {}, "", flat)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            flat[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{key.strip()}: cannot parse {text!r}: {e}") from e
    cfg = _build(ExperimentConfig, flat, "")
    try:
        _check_tokenizer(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return cfg


def _flatten(doc: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in doc.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, dotted + ".", out)
        else:
            out[dotted] = value


def _build(cls: type, flat: dict[str, Any], prefix: str) -> Any:
    """Instantiates dataclass `cls` from the `prefix`-ed keys of `flat` (consumed as used)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    mine = {k[len(prefix) :]: k for k in flat if k.startswith(prefix)}
    for rel, full in mine.items():
        head = rel.split(".")[0]
        special = cls is ModelConfig and rel == "preset"
        if head not in fields and not special:
            raise ConfigError(f"{full}: unknown key")
    kwargs: dict[str, Any] = {}
    base = _model_base(flat, prefix) if cls is ModelConfig else None
    for name in fields:
        hint = hints[name]
        dotted = prefix + name
        if dataclasses.is_dataclass(hint):
            nested = [k for k in flat if k.startswith(dotted + ".")]
            if dotted in flat:
                raise ConfigError(f"{dotted}: expected a mapping of fields, got {flat[dotted]!r}")
            if nested:
                kwargs[name] = _build(hint, flat, dotted + ".")
        elif dotted in flat:
            kwargs[name] = _coerce(flat[dotted], hint, dotted)
    if base is not None and base.hf_path:
        _check_runtime_only(base, kwargs, prefix)
    try:
        if base is not None:
            return dataclasses.replace(base, **kwargs)
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        where = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"{where}: {e}") from e


def _model_base(flat: dict[str, Any], prefix: str) -> ModelConfig:
    """The ModelConfig that `model.*` overrides apply to: `model.hf_path`'s config.json when set,
    else `model.preset` (default "tiny")."""
    hf_path = flat.get(prefix + "hf_path")
    if hf_path:
        if prefix + "preset" in flat:
            raise ConfigError(f"{prefix}preset: cannot be combined with {prefix}hf_path")
        try:
            return hf.config_from_dir(str(hf_path))
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{prefix}hf_path: {e}") from e
    preset = flat.get(prefix + "preset", "tiny")
    if preset not in PRESETS:
        raise ConfigError(f"{prefix}preset: unknown preset {preset!r}; known: {sorted(PRESETS)}")
    return PRESETS[preset]


def _check_runtime_only(base: ModelConfig, kwargs: dict[str, Any], prefix: str) -> None:
    """With `model.hf_path`, an architecture field may only repeat config.json's value."""
    for name, value in kwargs.items():
        if name in RUNTIME_FIELDS or name == "hf_path" or value == getattr(base, name):
            continue
        raise ConfigError(
            f"{prefix}{name}: {value!r} contradicts {base.hf_path}/config.json "
            f"({getattr(base, name)!r}); with {prefix}hf_path only {', '.join(RUNTIME_FIELDS)} "
            "may be set"
        )


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Checks `value` against a field annotation (int, float, bool, str, tuple[...], X | None)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} does not match {hint}")
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads `5e-4` (no dot) as a string; it is still plainly a float.
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
    elif hint is str:
        if value is None:  # `key=` on the command line
            return ""
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    elif origin is tuple:
        if isinstance(value, list | tuple):
            elem = args[0] if args else Any
            return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    else:
        return value
    raise ConfigError(f"{key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def make_tokenizer(cfg: ExperimentConfig) -> Tokenizer:
    """The tokenizer `cfg` names: `task.tokenizer` ("char" over `task.alphabet`, or "hf" from
    `task.tokenizer_path`, default `model.hf_path`), with `rollout.stop_token_ids` as extra stops.

    Raises:
      ValueError: one line naming the key, for missing tokenizer files or a chat template the
        tokenizer lacks (`_check_tokenizer`).
    """
    if cfg.tokenizer_kind == "char":
        return CharTokenizer(cfg.task.alphabet, stop_ids=cfg.rollout.stop_token_ids)
    from sat_jax.tasks.hf_tokenizer import HFTokenizer  # imports transformers on construction

    return HFTokenizer(
        cfg.tokenizer_path,
        chat_template=cfg.task.chat_template,
        system_prompt=cfg.task.system_prompt,
        stop_ids=cfg.rollout.stop_token_ids,
        checkpoint=cfg.model.hf_path,
        path_key=_path_key(cfg),
    )


def _check_tokenizer(cfg: ExperimentConfig) -> None:
    """Checks the files an "hf" tokenizer needs without loading it (`load_config` calls this).

    Raises:
      ValueError: one line naming the key (see `hf_tokenizer.check_tokenizer_files`).
    """
    if cfg.tokenizer_kind == "hf":
        from sat_jax.tasks.hf_tokenizer import check_tokenizer_files

        check_tokenizer_files(
            cfg.tokenizer_path, chat_template=cfg.task.chat_template, key=_path_key(cfg)
        )


def _path_key(cfg: ExperimentConfig) -> str:
    return "task.tokenizer_path" if cfg.task.tokenizer_path else "model.hf_path"
