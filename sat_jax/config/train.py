"""The trainer's config: the ``train.*`` keys (docs/DESIGN.md §7, §8).

``TrainConfig`` holds the run's schedule and staleness policy, the step's options and, nested by
concept, the parts its builders take whole: ``train.optimizer.*`` (``OptimizerConfig``, built
with ``make(num_steps)``), ``train.checkpoint.*`` (``CheckpointConfig``), ``train.warmup.*``
(``WarmupConfig``), ``train.client.*`` (``ClientConfig``, how the trainer reaches its servers)
and ``train.eval.*`` (``EvalConfig``). Every default lives once, in the dataclass that owns the
key; nothing is copied between sections.
"""

from __future__ import annotations

import dataclasses
import os

from sat_jax.config.step import StepConfig
from sat_jax.objectives import PolicyLossConfig, SATConfig
from sat_jax.optimizer import OptimizerConfig
from sat_jax.sharding import MeshConfig

_SAT_LOSS = PolicyLossConfig(sat=SATConfig(enabled=True))
# Frozen, so one shared default instance is safe.
_ONE_AXIS_MESH = MeshConfig()
# What an unset recipe option means where it acts (``TrainConfig.filter_rounds``, ...).
_FILTER_MAX_ROUNDS = 4
_OVERLONG_PENALTY = 1.0


def _positive(part: object, *names: str) -> None:
    for name in names:
        if getattr(part, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(part, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """The supervised warm-up before RL (``train.warmup.run`` runs it, or loads it from its cache).

    Attributes:
      steps: supervised steps on the task (0 = no warm-up).
      batch, learning_rate: the warm-up's batch size and Adam rate.
      cache_dir: where results are cached, one directory per warm-up setting (the initial
        params' seed, ``train.seed``, is part of the cache key).
    """

    steps: int = 0
    batch: int = 64
    learning_rate: float = 3e-3
    cache_dir: str = "runs/sft_cache"

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        _positive(self, "batch")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The trainer's checkpoints (``train.checkpointing.Checkpointer.from_config`` opens them).

    Attributes:
      dir: orbax checkpoints, a local path or a URL such as "gs://bucket/path" (passed to orbax
        unchanged: etils epath with GCS credentials); "" = "<run_dir>/checkpoints".
      every: save a checkpoint every k updates (and at the end).
      keep: how many checkpoints to keep.
    """

    dir: str = ""
    every: int = 10
    keep: int = 3

    def __post_init__(self) -> None:
        _positive(self, "every", "keep")

    def directory(self, run_dir: str) -> str:
        """``dir``, or ``<run_dir>/checkpoints`` when it is empty."""
        return self.dir or os.path.join(run_dir, "checkpoints")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Connection:
    """How the trainer's server pool reaches and waits for its servers (``ClientConfig.connection``
    builds it; the fields are ``train.remote.ServerPool``'s keyword arguments of the same names).

    Attributes:
      token: ``server.token``, sent as a bearer token on every call ("" = none).
      root_certificates: the PEM CA of ``train.tls_ca`` (None = plaintext).
      max_message_bytes: ``server.max_message_bytes``, the largest reply the channels accept.
      retry_max_s, server_wait_s, grace_s, servers_file: ``train.client.retry_max_s``,
        ``wait_s``, ``grace_s`` and ``servers_file``.
    """

    token: str
    root_certificates: bytes | None
    max_message_bytes: int
    retry_max_s: float
    server_wait_s: float
    grace_s: float
    servers_file: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """How the trainer reaches its rollout servers (``connection`` builds the pool's part;
    ``train.setup.connect`` the pool).

    The servers' own ``server.token`` and ``server.max_message_bytes`` and the trainer's
    ``train.tls_ca`` complete the connection.

    Attributes:
      servers: rollout server addresses ("host:port"); empty = start one local server process
        with this experiment's config (its ``server.checkpoint_root`` and ``server.state_dir``
        default to ``train.run_dir`` and "<run_dir>/server").
      servers_file: a file of "host:port" lines, re-read every few seconds: new lines join the
        fleet, removed ones leave ("" = none; with ``servers`` empty and this set, no local
        server).
      pull_timeout_s: how long one Pull waits for groups.
      retry_max_s: the longest backoff between retries while a server is down.
      wait_s: give up when no server answered, or none sent a group, for this long.
      grace_s: a server whose calls keep failing this long leaves the pull rotation and the
        push set (the run goes on with the others); it is probed and rejoins when it answers.
    """

    servers: tuple[str, ...] = ()
    servers_file: str = ""
    pull_timeout_s: float = 30.0
    retry_max_s: float = 10.0
    wait_s: float = 600.0
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        for name in ("pull_timeout_s", "retry_max_s", "wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for address in self.servers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"servers: {address!r} is not host:port")

    def connection(self, *, token: str, max_message_bytes: int, tls_ca: str) -> Connection:
        """The pool's ``Connection``: this section's retry, wait and fleet-file settings, with
        the servers' ``token`` and ``max_message_bytes`` and the CA file ``tls_ca`` ("" =
        plaintext).

        Raises:
          OSError: ``tls_ca`` cannot be read.
        """
        certificates = None
        if tls_ca:
            with open(tls_ca, "rb") as f:
                certificates = f.read()
        return Connection(
            token=token,
            root_certificates=certificates,
            max_message_bytes=max_message_bytes,
            retry_max_s=self.retry_max_s,
            server_wait_s=self.wait_s,
            grace_s=self.grace_s,
            servers_file=self.servers_file,
        )

    @property
    def local_server(self) -> bool:
        """Whether the trainer starts its own server process (no ``servers``, no file)."""
        return not self.servers and not self.servers_file


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The trainer's held-out evaluation (greedy exact-match accuracy on generated arithmetic
    problems the server never sees; ``sat-eval`` evaluates any task).

    Attributes:
      problems: held-out problems (0 = no evaluation); needs ``task.source`` "arithmetic"
        (a file task is evaluated with ``sat-eval``).
      every: evaluate every k updates during RL (0 = only before and after).
    """

    problems: int = 0
    every: int = 0

    def __post_init__(self) -> None:
        for name in ("problems", "every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The trainer (docs/DESIGN.md §7): schedule, staleness policy, the step's options, parts.

    The batch (``rollout.batch_groups`` groups of ``rollout.group_size``) and the staleness bound
    (``rollout.max_staleness``) are shared with the server's admission rule and live in
    ``rollout``. The step's options (``loss``, ``routing_replay``, ``microbatches``,
    ``old_logp``, ``advantage_estimator``, ``normalize_std``) build the step's ``StepConfig``
    (``step_options``, given ``rollout.temperature`` and the truncation replay).

    Attributes:
      mode: "async" (generation keeps running while the trainer steps) or "sync" (generation
        waits for the new weights: needs ``rollout.max_staleness = 0`` and
        ``weight_sync_interval = 1``, so every trained token has lag 0).
      steps: RL updates to apply (skipped steps do not count).
      max_skipped_steps: a run whose last ``max_skipped_steps`` consecutive steps were all
        skipped (nothing active, or a non-finite loss or gradient) writes a checkpoint and ends
        with exit status 1 and one line naming the likely cause (``train.skips``); 0 = never.
      weight_sync_interval: n, push weights to the servers every n updates (the configured lag).
      stale_policy: what happens to a group with a token older than ``rollout.max_staleness``
        versions: "drop" (counted in ``stale_dropped``) or "keep" (trained, still counted).
      routing_replay: replay the rollout's recorded expert ids in the train step (R3).
      microbatches: k, the batch is split into k microbatches whose gradients are accumulated
        (docs/DESIGN.md §5): loss, gradient and metrics equal the one-pass step's; the batch size
        must be divisible by k. SAT's threshold scope is ``loss.sat.threshold_scope``.
      length_bucket: a batch's time axis is padded to the smallest of ``length_bucket`` · 2^k
        (k ≥ 0) and the capacity that holds its longest row, so the step compiles once per
        bucket (docs/DESIGN.md §7.1); 0 = always the capacity.
      packing: pack the batch's trajectories into rows of ``row_tokens`` tokens (best-fit
        decreasing; segment ids keep attention within a trajectory, positions restart per
        trajectory) instead of one right-padded row each (docs/DESIGN.md §3.5, §7.1); the step's
        loss, metrics and gradient are the padded step's. A trajectory longer than a row is
        never split: refused at config time when ``server.max_prefill_length`` + the most
        completion tokens (``rollout.max_new_tokens``, or a multi-turn episode's) exceeds it,
        else rejected to its server with a logged reason.
      row_tokens: a packed row's length (0 = the capacity, longest prompt + longest
        completion; refused without ``packing``); a packed row's length is bucketed like
        ``length_bucket``'s, and the rows per microbatch are rounded up to at most 5
        significant bits times the data shards' quantum (``sat_jax.packing.row_bucket``: at
        most 1/16 spare); metric ``compiled_programs`` counts the step's shapes.
      microbatch_tokens: with ``packing``, split each batch by tokens instead of rows: the batch
        is packed once, then into k microbatches of r rows chosen together (r × row length
        within this budget, the fewest rows, then the fewest k; any k;
        ``sat_jax.packing.budget_layout``), exactly accumulated like ``microbatches``' (which
        must then be 1); >= a row's length. 0 = off.
      loss: the policy objective; SAT on by default.
      old_logp: the proximal log-probs of the objective: "behavior" (the sampler's, the
        default) or "recompute" (the current params' own before the update, AReaL's decoupled
        objective: TIS, IcePop and the sequence corrections then weigh behavior → proximal;
        docs/DESIGN.md §3.4).
      advantage_estimator: GRPO ("grpo") or Dr.GRPO ("dr_grpo": centered only, never divided
        by the group's std).
      normalize_std: GRPO's division by the group's std (unset = true); refused with "dr_grpo",
        which never divides (``divides_std``).
      filter_groups: DAPO's dynamic sampling: "none", or "all_equal": a pulled group whose
        trajectories' raw rewards (before overlong shaping) are all exactly equal (zero
        advantage) is not trained but rejected to its server, which generates a replacement,
        and the trainer pulls on (metric ``groups_filtered``).
      filter_max_rounds: at most ``filter_max_rounds`` · ``rollout.batch_groups`` groups are
        filtered while filling one batch; past that the rest of the batch is filled without the
        filter, with a warning (>= 1).
      overlong: a truncated trajectory (finish reason "length"; an episode any of whose turns
        was cut): "none"; "mask" (its loss mask is 0; its reward still counts in its group's
        baseline); or "soft" (DAPO's soft overlong punishment, with L_max =
        ``rollout.max_new_tokens``, L_cache = ``overlong_cache``, added to every trajectory's
        reward: −``overlong_penalty`` when truncated, else 0 up to L_max − L_cache tokens of its
        longest turn, then ``overlong_penalty`` · ((L_max − L_cache) − length) / L_cache).
        Metric ``overlong_frac``.
      overlong_cache: L_cache; "soft" needs 0 < overlong_cache <= ``rollout.max_new_tokens``,
        and only "soft" reads it (refused otherwise).
      overlong_penalty: the soft punishment's factor (>= 0): it ranges over [−penalty, 0]
        (unset = 1, ``soft_penalty``); only "soft" reads it (refused otherwise).
      mesh: the device mesh of the train step.
      run_dir: logs, checkpoints, plots and weights for the server; a local directory (the
        server loads weights from it); "" = "runs/<name>".
      tls_ca: PEM file of the CA (or self-signed certificate) to verify the servers with; set,
        the trainer connects over TLS ("" = plaintext).
      seed: the trainer's PRNG seed (the initial params; part of the warm-up's cache key).
      wandb: also log to Weights & Biases (needs the ``wandb`` package).
      optimizer, checkpoint, warmup, client, eval: the parts (``train.optimizer.*``, ...).
    """

    mode: str = "async"
    steps: int = 100
    max_skipped_steps: int = 100
    weight_sync_interval: int = 1
    stale_policy: str = "drop"
    routing_replay: bool = True
    microbatches: int = 1
    length_bucket: int = 64
    packing: bool = False
    row_tokens: int = 0
    microbatch_tokens: int = 0
    loss: PolicyLossConfig = _SAT_LOSS
    old_logp: str = "behavior"
    advantage_estimator: str = "grpo"
    normalize_std: bool | None = None
    filter_groups: str = "none"
    filter_max_rounds: int | None = None
    overlong: str = "none"
    overlong_cache: int = 0
    overlong_penalty: float | None = None
    mesh: MeshConfig = _ONE_AXIS_MESH
    run_dir: str = ""
    tls_ca: str = ""
    seed: int = 0
    wandb: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    warmup: WarmupConfig = WarmupConfig()
    client: ClientConfig = ClientConfig()
    eval: EvalConfig = EvalConfig()

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
        _positive(self, "steps", "weight_sync_interval", "microbatches")
        if self.filter_max_rounds is not None:
            _positive(self, "filter_max_rounds")
        for name in (
            "max_skipped_steps",
            "length_bucket",
            "overlong_cache",
            "row_tokens",
            "microbatch_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.overlong_penalty is not None and not 0 <= self.overlong_penalty < float("inf"):
            raise ValueError(
                f"overlong_penalty must be finite and >= 0, got {self.overlong_penalty}"
            )
        if self.overlong == "soft" and self.overlong_cache == 0:
            raise ValueError("overlong 'soft' needs overlong_cache > 0")
        self._check_inert()
        if "://" in self.run_dir:
            raise ValueError(
                f"run_dir must be a local directory, got {self.run_dir!r}; put checkpoints on a "
                "URL with checkpoint.dir"
            )
        if self.mode == "sync" and self.weight_sync_interval != 1:
            raise ValueError("mode 'sync' needs weight_sync_interval = 1")
        self._check_old_logp()

    def _check_inert(self) -> None:
        """Refuses an option that would do nothing in its combination, naming both keys."""
        if self.advantage_estimator == "dr_grpo" and self.normalize_std is not None:
            raise ValueError(
                "normalize_std is inert with advantage_estimator 'dr_grpo' (Dr.GRPO never "
                "divides by the group's std): drop normalize_std, or use 'grpo'"
            )
        if self.row_tokens and not self.packing:
            raise ValueError(
                "row_tokens is inert without packing (only a packed row has that length): "
                "drop it, or set packing true"
            )
        if self.filter_groups == "none" and self.filter_max_rounds is not None:
            raise ValueError(
                "filter_max_rounds is inert with filter_groups 'none' (no filter to bound): "
                "drop it, or set filter_groups 'all_equal'"
            )
        if self.overlong != "soft":
            unread = [
                name
                for name, unset in (
                    ("overlong_cache", self.overlong_cache == 0),
                    ("overlong_penalty", self.overlong_penalty is None),
                )
                if not unset
            ]
            if unread:
                verb = "is" if len(unread) == 1 else "are"
                raise ValueError(
                    f"{' and '.join(unread)} {verb} inert with overlong {self.overlong!r} (only "
                    "'soft' reads them): drop them, or set overlong 'soft'"
                )

    def step_options(self, *, temperature: float, kept_counts: bool) -> StepConfig:
        """The train step's options from this section: ``loss``, ``routing_replay``,
        ``microbatches``, the advantages (``advantage_estimator``, ``divides_std``) and
        ``old_logp``, with the sampler's ``temperature`` and whether the batch carries its kept
        counts (``rollout.temperature``, ``rollout.replays_truncation``)."""
        return StepConfig(
            loss=self.loss,
            routing_replay=self.routing_replay,
            temperature=temperature,
            microbatches=self.microbatches,
            estimator=self.advantage_estimator,
            normalize_std=self.divides_std,
            recompute_old_logp=self.old_logp == "recompute",
            kept_counts=kept_counts,
        )

    @property
    def divides_std(self) -> bool:
        """Whether the advantages are divided by their group's std: GRPO with
        ``normalize_std`` (unset = true); never under Dr.GRPO."""
        return self.advantage_estimator == "grpo" and self.normalize_std is not False

    @property
    def filter_rounds(self) -> int:
        """``filter_max_rounds``, or its default (4) when unset."""
        return _FILTER_MAX_ROUNDS if self.filter_max_rounds is None else self.filter_max_rounds

    @property
    def soft_penalty(self) -> float:
        """``overlong_penalty``, or its default (1) when unset."""
        return _OVERLONG_PENALTY if self.overlong_penalty is None else self.overlong_penalty

    def _check_old_logp(self) -> None:
        """The loss options that need proximal log-probs need "recompute", the clip-based ones
        do nothing with it (one update per batch: r = π/π_old is 1 at the update), and without
        one of the former it is unweighted, unclipped REINFORCE on stale samples."""
        loss = self.loss
        needs = loss.rollout_corrections
        if needs and self.old_logp != "recompute":
            raise ValueError(
                f"loss.{needs[0]} weighs behavior → proximal log-probs: it needs "
                "old_logp 'recompute' (with 'behavior' the weight would always be 1)"
            )
        if self.old_logp != "recompute":
            return
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
        if not needs:
            # No weight and no clip: the gradient would be −A/N per token, plain REINFORCE on
            # stale samples.
            raise ValueError(
                "old_logp 'recompute' needs a rollout correction: set loss.tis_cap, "
                "loss.icepop_range, loss.seq_tis_cap or loss.seq_mask_range "
                "(docs/DESIGN.md §3.4)"
            )
