"""Pulled trajectory groups → one fixed-shape ``TrainBatch``: the staleness policy, lag tagging and
the batch's stats (docs/DESIGN.md §7.1, the data path of one batch, steps 2 and 3).

Lag of a completion token = trainer version − the version of the weights that generated it
(docs/DESIGN.md §2, §7.2). Groups arrive as ``rollout_api.records`` (decoded and validated once,
where they were pulled). ``select_groups`` is the one place that decides which pulled groups are
trained: a group the pull refused (``InvalidGroup``: token or routing ids out of range, routing
that does not decode, per-token fields that do not line up) is rejected (logged); a group already
trained (its name, ``Group.key``, is among the recent ones: a server re-delivers a group whose
acknowledgement it did not get) is a duplicate; a group holding a token older than
``min_version`` (weights this trainer never published, e.g. a server's
random initial weights) is always dropped; a group whose oldest token lags more than
``max_staleness`` versions is dropped or kept by ``stale_policy``; with ``filter_groups``
"all_equal" (DAPO's dynamic sampling) a group that would be kept but whose trajectories' raw
rewards are all equal (zero advantage, nothing to learn) is filtered, up to a budget per batch
(``select_groups``). Every case is counted, and the counts travel with the kept groups
(``Selection``) into the batch's ``BatchStats``.

Overlong shaping (``BatchSpec.overlong``, applied by ``assemble_batch``): a trajectory is
truncated (overlong) when its ``finish_reason`` is "length", which for a multi-turn episode the
server records when ANY of its turns was cut by a limit (``rollout.max_new_tokens`` or the
episode's token budget), not only its last. Both modes read that one test: "mask" zeroes a
truncated trajectory's loss mask; "soft" adds DAPO's soft overlong punishment to its reward
(``overlong_penalty``): the full punishment for a truncated one (as for a completion cut at
L_max), and the graded one of its longest turn for any other.

Every batch has ``rows = batch_groups · group_size`` rows (missing rows, from dropped groups, are
padding with an all-zero loss mask) and a time axis bucketed by length (``bucket_length``): the
smallest of ``length_bucket · 2^k`` (k ≥ 0) and the capacity ``seq_len`` (longest prompt + longest
completion) that holds the batch's longest row, so the jitted step compiles once per bucket, a
handful of shapes. ``BatchStats.pad_frac`` is the fraction of the batch's token slots that are
padding after bucketing. ``empty_batch`` is the all-padding batch of a bucket: its shapes and
dtypes, from the spec and the bucket alone.

Lags are built once, as the flat vector of the trained completion tokens in row-major order
(``BatchStats.lags``); nothing builds them as [R, T].

Multi-turn trajectories (``Trajectory.loss_mask``, docs/DESIGN.md §6.2, §7.1): only the tokens
the policy generated are trained. An observation token (loss mask 0, inserted by the environment)
is context: it gets loss mask 0 in the batch, and its behavior log-prob and kept count
(unspecified on the wire) are replaced by the padding's (0, 0), so nothing the server put there
reaches the step; its routing is the one the server's cache extension recorded, which R3
replays like any other position's. Lags, the fresh mask, the staleness checks and every
per-token stat read the generated tokens only; a trajectory's advantage is its episode's
(its reward, spread over its generated tokens). ``response_len_mean`` counts generated tokens,
and the soft overlong punishment of an episode that is not truncated reads its longest turn
(run of generated tokens; ``rollout.max_new_tokens`` bounds each turn): for a single-turn
trajectory both are its completion length.

Forked HTTP sessions (``Group.sessions``, docs/DESIGN.md §6.6): a group holds G samples, a
forked session one trajectory per segment. Every segment is a row of its own (its tokens from
its loss mask, as any trajectory's), the rows grow to the next multiple of ``rows`` that holds
them, and ``TrainBatch.session_weights`` (1 / the session's segments) make the step's group
statistics count each session once, each segment taking its session's advantage. A batch
without forks carries no weights: it is the batch it always was.

Constrained decoding (``Trajectory.response_formats`` / ``format_index``, docs/DESIGN.md §6.6):
``select_groups`` replays each constrained reply's automaton with the trainer's tokenizer
(``BatchSpec.tokenizer``) and rejects a group a sampled token of which the replay does not allow
(``format_problem``); ``assemble_batch`` gives the batch the table of its distinct masks
(``TrainBatch.format_masks``, bit-packed) and each token's row (``format_ids``, 0 = free), which
the step's log-probs renormalize over. A batch without constrained tokens carries neither.

Alignment follows ``sat_jax.step.batch``: per-token arrays are indexed at the TARGET token, so the
completion token at position t has ``loss_mask[b, t] = 1`` and its ``behavior_logp[b, t]``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection, Sequence

import numpy as np

from rollout_api.records import Group, GroupLimits, InvalidGroup, Trajectory
from sat_jax import json_mask
from sat_jax.config import RolloutConfig, TrainConfig
from sat_jax.model.config import ModelConfig
from sat_jax.step import TrainBatch
from train.packing import pack_batch

log = logging.getLogger("train")

# Lag histogram bins 0, 1, ..., LAG_BINS - 2 and a last bin for everything older.
LAG_BINS = 9


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """The fixed shape of every batch and how groups become rows (``from_config`` builds it from
    the experiment's sections, which hold the defaults).

    Attributes:
      batch_groups: groups per batch.
      group_size: trajectories per group.
      seq_len: the capacity, the most tokens a row may have (prompt + completion).
      length_bucket: the smallest bucket of the time axis (``bucket_length``); 0 = every batch
        is padded to ``seq_len``.
      routing_lk: (L, K) of the recorded routing ids, or None to carry no routing.
      routing_dtype: "uint8" (≤ 256 experts) or "uint16"; fixed so the step compiles once.
      max_staleness: the largest lag a kept group may have under the "drop" policy.
      stale_policy: "drop" or "keep".
      vocab_size: token ids must be in [0, vocab_size).
      num_experts: routing ids must be in [0, num_experts).
      kept_counts: the batch carries the sampler's per-token kept-set sizes for the step's
        truncation replay (``rollout.replays_truncation``); a trajectory without them (a sampler
        that did not truncate) gets 0s: scored over the whole vocabulary.
      filter_groups: "none", or "all_equal": a group whose trajectories' raw rewards are all
        equal (exact float equality) is filtered (``select_groups``).
      filter_max_rounds: at most ``filter_max_rounds · batch_groups`` groups are filtered while
        filling one batch; past that the filter is off for the rest of that batch.
      overlong: "none", "mask" or "soft": what ``assemble_batch`` does with a truncated
        trajectory (finish reason "length": a turn was cut), see ``overlong_penalty`` and the
        module docstring.
      overlong_cache: L_cache, the soft punishment's window (tokens before ``max_new_tokens``).
      overlong_penalty: the soft punishment's factor: it ranges over [−overlong_penalty, 0].
      max_new_tokens: L_max, the completion length limit (the soft punishment's end).
      packing: pack the trajectories into rows of ``row_tokens`` (``pack_batch``) instead of
        one padded row each.
      row_tokens: a packed row's capacity (0 = ``seq_len``); a trajectory longer is rejected.
      microbatches: k of the step: packed trajectory n goes to microbatch n mod k (as the padded
        row n does), whose rows are the batch's rows j, j + k, ...
      row_multiple: a packed batch's row count is a multiple of it (the data-parallel shards).
      microbatch_tokens: with packing, a token budget per microbatch: the batch is packed once
        and split into k microbatches of r rows chosen together
        (``sat_jax.packing.budget_layout``), k carried as ``TrainBatch.microbatches``
        (``microbatches`` is then 1); 0 = off.
      tokenizer: the trainer's, to replay constrained decoding's masks (``response_format``,
        ``replay_formats``); None = a group carrying formats is rejected.
    """

    batch_groups: int
    group_size: int
    seq_len: int
    length_bucket: int
    routing_lk: tuple[int, int] | None
    routing_dtype: str
    max_staleness: int
    stale_policy: str
    vocab_size: int
    num_experts: int
    kept_counts: bool = False
    filter_groups: str = "none"
    filter_max_rounds: int = 4
    overlong: str = "none"
    overlong_cache: int = 0
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0
    packing: bool = False
    row_tokens: int = 0
    microbatches: int = 1
    row_multiple: int = 1
    microbatch_tokens: int = 0
    tokenizer: object = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(
        cls,
        rollout: RolloutConfig,
        train: TrainConfig,
        model: ModelConfig,
        *,
        seq_len: int,
        row_multiple: int = 1,
        tokenizer: object = None,
    ) -> BatchSpec:
        """The spec of the batches a run trains: the groups' shape and staleness bound from
        ``rollout``, the batch's rules from ``train`` (length bucket, stale policy, filter,
        overlong shaping, packing and microbatches), the token and routing ranges from ``model``.

        Args:
          rollout, train, model: the experiment's sections.
          seq_len: the row capacity, the server's prefill length + the most completion tokens.
          row_multiple: the data-parallel shards of the train mesh.
          tokenizer: the trainer's (constrained decoding's replay); None = none.
        """
        return cls(
            tokenizer=tokenizer,
            batch_groups=rollout.batch_groups,
            group_size=rollout.group_size,
            max_staleness=rollout.max_staleness,
            max_new_tokens=rollout.max_new_tokens,
            kept_counts=rollout.replays_truncation,
            seq_len=seq_len,
            length_bucket=train.length_bucket,
            stale_policy=train.stale_policy,
            filter_groups=train.filter_groups,
            filter_max_rounds=train.filter_rounds,
            overlong=train.overlong,
            overlong_cache=train.overlong_cache,
            overlong_penalty=train.soft_penalty,
            packing=train.packing,
            row_tokens=train.row_tokens,
            microbatches=train.microbatches,
            microbatch_tokens=train.microbatch_tokens,
            row_multiple=row_multiple,
            routing_lk=(
                (model.num_moe_layers, model.num_experts_per_tok) if train.routing_replay else None
            ),
            routing_dtype=np.dtype(model.routing_dtype).name,
            vocab_size=model.vocab_size,
            num_experts=model.num_experts,
        )

    def __post_init__(self) -> None:
        if self.filter_groups not in ("none", "all_equal"):
            raise ValueError(
                f"filter_groups must be 'none' or 'all_equal', got {self.filter_groups!r}"
            )
        if self.filter_max_rounds < 1:
            raise ValueError(f"filter_max_rounds must be >= 1, got {self.filter_max_rounds}")
        if self.overlong not in ("none", "mask", "soft"):
            raise ValueError(f"overlong must be 'none', 'mask' or 'soft', got {self.overlong!r}")
        if self.overlong == "soft" and not 0 < self.overlong_cache <= self.max_new_tokens:
            raise ValueError(
                f"overlong 'soft' needs 0 < overlong_cache <= max_new_tokens, got "
                f"{self.overlong_cache} and {self.max_new_tokens}"
            )

    @property
    def row_capacity(self) -> int:
        """The most tokens of one trajectory the batch takes (a packed row's length)."""
        return (self.row_tokens or self.seq_len) if self.packing else self.seq_len

    @property
    def filter_budget(self) -> int:
        """The most groups filtered while filling one batch."""
        return self.filter_max_rounds * self.batch_groups

    @property
    def rows(self) -> int:
        return self.batch_groups * self.group_size

    @property
    def limits(self) -> GroupLimits:
        """What a pulled group must fit (checked where it is pulled, ``ServerPool.pull``)."""
        return GroupLimits(
            vocab_size=self.vocab_size, num_experts=self.num_experts, routing_lk=self.routing_lk
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Selection:
    """Pulled groups after the duplicate check and the staleness policy: the ones to train and
    how many were not.

    Attributes:
      kept: the groups to train, in pull order.
      stale_dropped: groups dropped for staleness (incl. tokens older than ``min_version``).
      stale_kept: kept groups over ``max_staleness`` (the "keep" policy).
      duplicates: groups skipped because they (or their prompt id) were trained recently.
      invalid: groups the pull refused (``InvalidGroup``).
      filtered: groups filtered for all-equal rewards (``BatchSpec.filter_groups``).
      pulled: every pulled group (to acknowledge once the batch is trained).
    """

    kept: tuple[Group, ...]
    stale_dropped: int
    stale_kept: int
    duplicates: int
    invalid: int = 0
    filtered: int = 0
    pulled: tuple[Group | InvalidGroup, ...] = ()

    @classmethod
    def empty(cls) -> Selection:
        return cls(kept=(), stale_dropped=0, stale_kept=0, duplicates=0)

    def __add__(self, other: Selection) -> Selection:
        """Both selections' groups (``self``'s first) and summed counts."""
        return Selection(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchStats:
    """Host-side facts about one assembled batch (lags over the trained completion tokens).

    Attributes:
      groups: groups in the batch.
      stale_dropped, stale_kept, duplicates, invalid, filtered: the ``Selection`` counts of the
        groups pulled for it.
      reward_mean, response_len_mean: over the trained trajectories (0 when none); reward_mean
        is of the raw task rewards (before overlong shaping); response_len_mean counts the
        generated tokens (observation tokens of a multi-turn trajectory are not).
      tokens: trained completion tokens (generated, loss mask 1); prompt_ids: the trained
        groups' stable prompt ids; group_keys: their ``Group.key``s.
      pad_frac: padded token slots over all token slots [R, T] of the batch (T after
        bucketing; rows of dropped groups are padding too).
      lags: int64 [tokens], the lag of every trained completion token, in row-major order (the
        order of ``batch.loss_mask > 0``), built once by ``assemble_batch``; the histogram, mean
        and max below derive from it.
      overlong_frac: the fraction of the batch's trajectories (every row of a kept group, masked
        or not) that are truncated (finish reason "length"), whatever ``BatchSpec.overlong``.
    """

    groups: int
    stale_dropped: int
    stale_kept: int
    duplicates: int
    invalid: int
    reward_mean: float
    response_len_mean: float
    tokens: int
    prompt_ids: tuple[str, ...]
    group_keys: tuple[str, ...]
    pad_frac: float
    lags: np.ndarray
    filtered: int = 0
    overlong_frac: float = 0.0

    @property
    def lag_hist(self) -> np.ndarray:
        """int [LAG_BINS] counts of lag 0, 1, ..., and ≥ LAG_BINS − 1."""
        return np.bincount(np.clip(self.lags, 0, LAG_BINS - 1), minlength=LAG_BINS)

    @property
    def lag_mean(self) -> float:
        return float(self.lags.mean()) if self.lags.size else 0.0

    @property
    def lag_max(self) -> int:
        return int(self.lags.max()) if self.lags.size else 0

    def to_json(self) -> bytes:
        """Every field but ``lags`` as JSON (for the multi-host broadcast, docs/DESIGN.md §7.3)."""
        fields = dataclasses.fields(self)
        return json.dumps(
            {f.name: getattr(self, f.name) for f in fields if f.name != "lags"}
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, *, lags: np.ndarray) -> BatchStats:
        """The inverse of ``to_json``, with the ``lags`` given separately."""
        fields = json.loads(data)
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}, lags=lags
        )


def select_groups(
    groups: Sequence[Group | InvalidGroup],
    spec: BatchSpec,
    *,
    trainer_version: int,
    min_version: int,
    seen_groups: Collection[str] = (),
    filter_budget: int | None = None,
) -> Selection:
    """Applies the duplicate check and the staleness policy (see the module docstring) to pulled
    groups; the only place either runs (docs/DESIGN.md §7.1, step 2).

    Args:
      groups: pulled groups (``ServerPool.pull``'s records).
      spec: ``max_staleness`` and ``stale_policy``.
      trainer_version: version of the weights being trained.
      min_version: groups with a token of an older version are dropped.
      seen_groups: ``Group.key``s of recently trained groups; those are skipped as duplicates,
        and so is a group whose key came earlier in ``groups``. Only the group's name counts: a
        prompt trained recently may come again (a dataset smaller than the run is repeated), as
        a new group.
      filter_budget: with ``spec.filter_groups`` "all_equal", the most groups this call may
        filter (None = ``spec.filter_budget``); once that many are filtered, the next groups are
        kept whatever their rewards (``pulling.pull_batch`` passes what is left of the batch's).
        A group is filtered when it would be kept (also a stale one under the "keep" policy) and
        its trajectories' raw rewards are all exactly equal (float equality: the rewards are
        float32 from the task).
    """
    kept, dropped, stale_kept, duplicates, invalid, filtered = [], 0, 0, 0, 0, 0
    budget = spec.filter_budget if filter_budget is None else filter_budget
    filtering = spec.filter_groups == "all_equal"
    seen = set(seen_groups)
    for group in groups:
        key = group.key
        problem = group.problem if isinstance(group, InvalidGroup) else None
        if problem is None and key not in seen:
            problem = _unfit(group, spec)
        if problem is not None:  # rejected to its server, never trained
            invalid += 1
            log.warning("rejecting group %s from the server: %s", key, problem)
            seen.add(key)
            continue
        # A group without completion tokens has lag 0.
        oldest = _oldest_version(group)
        if key in seen:
            duplicates += 1
        elif oldest is not None and oldest < min_version:
            dropped += 1
        elif oldest is not None and trainer_version - oldest > spec.max_staleness:
            if spec.stale_policy == "drop":
                dropped += 1
            elif filtering and filtered < budget and _all_equal(group):
                filtered += 1
            else:
                kept.append(group)
                stale_kept += 1
        elif filtering and filtered < budget and _all_equal(group):
            filtered += 1
        else:
            kept.append(group)
        seen.add(key)
    return Selection(
        kept=tuple(kept),
        stale_dropped=dropped,
        stale_kept=stale_kept,
        duplicates=duplicates,
        invalid=invalid,
        filtered=filtered,
        pulled=tuple(groups),
    )


def _unfit(group: Group, spec: BatchSpec) -> str | None:
    """Why a pulled group cannot be trained (None: it can): with packing, a trajectory longer
    than a row (never truncated); constrained decoding the trainer cannot replay
    (``format_problem``)."""
    longest = max((t.num_tokens for t in group.trajectories), default=0)
    if spec.packing and longest > spec.row_capacity:
        return (
            f"a trajectory of {longest} tokens exceeds the row of {spec.row_capacity} "
            "(train.row_tokens)"
        )
    return format_problem(group, spec)


def format_problem(group: Group, spec: BatchSpec) -> str | None:
    """Why a group's constrained decoding cannot be replayed (None: it can, or it has none): no
    tokenizer, a format that cannot be rebuilt, or a sampled token the trainer's replay of its
    format's mask does not allow (a tokenizer other than the server's, a malformed trajectory).
    Its log-probs would then be scored under another distribution than the one that sampled
    them, so the group is rejected rather than trained (``select_groups``)."""
    constrained = [i for i, t in enumerate(group.trajectories) if t.format_index is not None]
    if not constrained:
        return None
    if spec.tokenizer is None:
        return "it carries response formats and the trainer has no tokenizer to replay their masks"
    table = json_mask.MaskTable(spec.tokenizer, spec.vocab_size)
    for i in constrained:
        t = group.trajectories[i]
        try:
            table.trajectory(t.response_formats, t.format_index, t.completion_ids)
        except ValueError as e:
            return f"trajectory {i}: {e} (the trainer's replay of its response_format)"
    return None


def _all_equal(group: Group) -> bool:
    """Whether the group's trajectories' raw rewards are all exactly equal (zero advantage)."""
    first = group.trajectories[0].reward if group.trajectories else 0.0
    return all(t.reward == first for t in group.trajectories)


def overlong_shaping(length: int, spec: BatchSpec) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens, added to its reward
    under ``spec.overlong`` "soft": with L_max = ``max_new_tokens`` and L_cache =
    ``overlong_cache``, 0 up to L_max − L_cache tokens, then
    ``overlong_penalty · ((L_max − L_cache) − length) / L_cache`` up to L_max (so down to
    −``overlong_penalty``), and −``overlong_penalty`` past L_max (a server never returns that)."""
    start = spec.max_new_tokens - spec.overlong_cache
    if length <= start:
        return 0.0
    if length > spec.max_new_tokens:
        return -spec.overlong_penalty
    return spec.overlong_penalty * (start - length) / spec.overlong_cache


def _oldest_version(group: Group) -> int | None:
    """The oldest weights version of the group's generated tokens (None: it has none); the
    versions of observation tokens are unspecified and not read."""
    versions = [t.versions[t.generated] for t in group.trajectories]
    return min((int(v.min()) for v in versions if v.size), default=None)


def longest_turn(traj: Trajectory) -> int:
    """The longest run of generated tokens of a trajectory: its completion length when it is
    single-turn, its longest assistant turn when it is multi-turn."""
    if traj.loss_mask is None:
        return len(traj.completion_ids)
    change = np.flatnonzero(
        np.diff(np.concatenate([[False], traj.loss_mask, [False]]).astype(np.int8))
    )
    starts, ends = change[::2], change[1::2]
    return int((ends - starts).max(initial=0))


def bucket_length(longest: int, spec: BatchSpec, cap: int | None = None) -> int:
    """The time length T of a batch whose longest row has ``longest`` tokens: the smallest
    ``spec.length_bucket · 2^k`` (k ≥ 0) that holds it, capped at ``cap`` (default
    ``spec.seq_len``; a packed row's is ``spec.row_capacity``), always ``cap`` when
    ``length_bucket`` is 0."""
    cap = spec.seq_len if cap is None else cap
    if spec.length_bucket <= 0:
        return cap
    t = spec.length_bucket
    while t < longest:
        t *= 2
    return min(t, cap)


def assemble_batch(
    selection: Selection, spec: BatchSpec, *, trainer_version: int
) -> tuple[TrainBatch, BatchStats]:
    """Builds the padded ``TrainBatch`` (NumPy arrays) of the selected groups and its stats
    (docs/DESIGN.md §7.1, step 3).

    Args:
      selection: ``select_groups``' result; at most ``spec.batch_groups`` kept groups of
        ``spec.group_size`` samples each: one trajectory per sample, or, for a group of forked
        HTTP sessions (``Group.sessions``), one per segment of each session.
      spec: the batch shape.
      trainer_version: version of the weights being trained (for the lags).

    Overlong shaping (``spec.overlong``; truncated = finish reason "length", an episode with a
    cut turn): "mask" zeroes a truncated trajectory's loss mask (it leaves the loss and its
    tokens the lags, but keeps its group id, so its reward still counts in its group's advantage
    baseline); "soft" adds ``overlong_shaping`` to every trajectory's reward: of L_max for a
    truncated one (the full punishment), of its longest turn (``longest_turn``) for any other
    (the batch's ``rewards``; ``stats.reward_mean`` stays the raw reward).
    Observation tokens (``Trajectory.loss_mask`` 0) are out of the loss mask, the lags and the
    fresh mask, and carry the padding's behavior log-prob and kept count (their recorded
    routing stays).

    Returns:
      ``(batch, stats)``: tokens [R, T] int32 (T = ``bucket_length`` of the longest row),
      loss_mask / behavior_logp [R, T] float32, rewards [R] float32 and group_ids [R] int32 (the
      group's index in the batch; -1 on padding rows), from which the train step computes the
      advantages, routing [R, T, L, K] (when ``spec.routing_lk``), kept_counts [R, T] int32
      (when ``spec.kept_counts``), fresh_mask [R, T] uint8 (1 on the completion tokens of
      the trainer's own version, lag 0: ``sampler_kl``'s tokens); rows past the kept
      trajectories are padding (mask 0). ``stats``
      carries the selection's counts and the lags of the trained tokens.
      R is ``spec.rows``; forked sessions' segments may need more trajectories than that: R is
      then the next multiple of ``spec.rows`` that holds them (every divisibility of the rows
      holds), and ``session_weights`` [R] weigh each segment 1 / its session's segments in its
      group's statistics (one reward per session; each segment takes its session's advantage).
      A batch without forks has no ``session_weights`` (None).

    Raises:
      ValueError: too many groups, a group of the wrong size (of samples), a trajectory longer than
        ``seq_len``, or a routing that does not fit ``spec.routing_lk``.
    """
    kept = selection.kept
    if len(kept) > spec.batch_groups:
        raise ValueError(f"{len(kept)} groups for a batch of {spec.batch_groups}")
    for group in kept:
        _check_samples(group, spec)
    row_tokens = [t.num_tokens for g in kept for t in g.trajectories]
    rows = spec.rows * max(1, -(-len(row_tokens) // spec.rows))
    fill = _Rows(spec, rows, bucket_length(max(row_tokens, default=0), spec), trainer_version)
    forked = any(g.sessions for g in kept)
    row = 0
    for g, group in enumerate(kept):
        for traj, weight in zip(group.trajectories, _session_weights(group), strict=True):
            fill.add(row, traj, g, weight)
            row += 1
    batch, slots = fill.batch(forked), rows * fill.length
    if spec.packing:
        batch, used, slots = pack_batch(batch, spec)
        row_tokens = [used]
    lengths = fill.lengths
    stats = BatchStats(
        groups=len(kept),
        stale_dropped=selection.stale_dropped,
        stale_kept=selection.stale_kept,
        duplicates=selection.duplicates,
        invalid=selection.invalid,
        filtered=selection.filtered,
        reward_mean=fill.reward_mean(forked),
        response_len_mean=float(np.mean(lengths)) if lengths else 0.0,
        tokens=int(fill.mask.sum()),
        prompt_ids=tuple(g.prompt_id for g in kept),
        group_keys=tuple(g.key for g in kept),
        pad_frac=1.0 - sum(row_tokens) / slots,
        lags=np.concatenate(fill.lags) if fill.lags else np.zeros(0, np.int64),
        overlong_frac=fill.truncated / len(lengths) if lengths else 0.0,
    )
    return batch, stats


def _check_samples(group: Group, spec: BatchSpec) -> None:
    """Raises ValueError unless ``group`` holds ``spec.group_size`` samples (trajectories, or
    sessions of segments)."""
    samples = group.sessions[-1] + 1 if group.sessions else len(group.trajectories)
    if samples != spec.group_size:
        what = "sessions" if group.sessions else "trajectories"
        raise ValueError(f"group {group.group_id} has {samples} {what}, expected {spec.group_size}")


def _session_weights(group: Group) -> np.ndarray:
    """float32 per trajectory: 1 / the segments of its session (1 each without forks)."""
    ids = group.session_ids
    return (1.0 / np.bincount(ids)[ids]).astype(np.float32)


class _Rows:
    """The per-row arrays of a padded batch of ``rows`` rows of ``length`` tokens, filled one
    trajectory at a time (``add``), with what the stats read (lags, generated lengths,
    truncated trajectories)."""

    def __init__(self, spec: BatchSpec, rows: int, length: int, trainer_version: int):
        self.spec, self.length, self.version = spec, length, trainer_version
        self.tokens, self.mask, self.behavior, self.routing = _padding(spec, length, rows)
        self.kept_counts = np.zeros((rows, length), np.int32) if spec.kept_counts else None
        self.fresh = np.zeros((rows, length), np.uint8)  # 1 byte per token to the device
        self.lags: list[np.ndarray] = []  # per row, in row order: the trained tokens' lags
        self.rewards = np.zeros(rows, np.float32)
        self.group_ids = np.full(rows, -1, np.int32)
        self.weights = np.zeros(rows, np.float32)
        self.active = np.zeros(rows, bool)
        self.lengths: list[int] = []
        self.shaping = np.zeros(rows, np.float32)  # overlong "soft": added to the rewards
        self.truncated = 0
        # Constrained decoding: each token's mask row (0 = free), made when a trajectory has one.
        self.formats: json_mask.MaskTable | None = None
        self.format_ids: np.ndarray | None = None

    def add(self, row: int, traj: Trajectory, group: int, weight: float) -> None:
        """Writes ``traj``, of the batch's group ``group``, into ``row``."""
        spec = self.spec
        _fill_row(row, traj, spec, self.tokens, self.mask, self.behavior, self.routing)
        p, c = len(traj.prompt_ids), len(traj.completion_ids)
        generated = traj.generated
        if self.kept_counts is not None and traj.kept_counts is not None:
            self.kept_counts[row, p : p + c] = np.where(generated, traj.kept_counts, 0)
        if traj.format_index is not None:
            self._add_formats(row, p, traj)
        is_truncated = traj.finish_reason == "length"
        self.truncated += is_truncated
        if spec.overlong == "mask" and is_truncated:
            self.mask[row] = 0.0
        else:
            self.fresh[row, p : p + c] = generated & (traj.versions == self.version)
            self.lags.append(self.version - traj.versions[generated])
        self.rewards[row], self.group_ids[row], self.active[row] = traj.reward, group, True
        self.weights[row] = weight
        self.lengths.append(traj.num_generated)
        if spec.overlong == "soft":
            length = spec.max_new_tokens if is_truncated else longest_turn(traj)
            self.shaping[row] = overlong_shaping(length, spec)

    def _add_formats(self, row: int, p: int, traj: Trajectory) -> None:
        """Writes the mask rows of ``traj``'s constrained tokens (replayed with the trainer's
        tokenizer; ``select_groups`` rejected a group whose replay fails)."""
        if self.formats is None:
            self.formats = json_mask.MaskTable(self.spec.tokenizer, self.spec.vocab_size)
            self.format_ids = np.zeros_like(self.tokens)
        rows = self.formats.trajectory(
            traj.response_formats, traj.format_index, traj.completion_ids
        )
        self.format_ids[row, p : p + len(rows)] = rows

    def reward_mean(self, forked: bool) -> float:
        """The raw rewards' mean over the trajectories (over the sessions when ``forked``)."""
        if not self.active.any():
            return 0.0
        if forked:
            return float(np.sum(self.rewards * self.weights) / np.sum(self.weights))
        return float(self.rewards[self.active].mean())

    def batch(self, forked: bool) -> TrainBatch:
        """The padded ``TrainBatch`` (with ``session_weights`` only when ``forked``)."""
        spec = self.spec
        return TrainBatch(
            tokens=self.tokens,
            loss_mask=self.mask,
            behavior_logp=self.behavior,
            rewards=self.rewards + self.shaping if spec.overlong == "soft" else self.rewards,
            group_ids=self.group_ids,
            session_weights=self.weights if forked else None,
            routing=None if self.routing is None else self.routing.astype(spec.routing_dtype),
            kept_counts=self.kept_counts,
            fresh_mask=self.fresh,
            format_ids=self.format_ids if self.formats else None,
            format_masks=self.formats.packed(spec.row_multiple) if self.formats else None,
        )


def empty_batch(spec: BatchSpec, length: int) -> TrainBatch:
    """The all-padding batch of ``spec`` with ``length`` positions: the shapes and dtypes of every
    batch ``assemble_batch`` builds in that length bucket (what a process that receives a
    broadcast batch fills, docs/DESIGN.md §7.3)."""
    tokens, mask, behavior, routing = _padding(spec, length)
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logp=behavior,
        rewards=np.zeros(spec.rows, np.float32),
        group_ids=np.full(spec.rows, -1, np.int32),
        routing=routing,
        kept_counts=np.zeros_like(tokens) if spec.kept_counts else None,
        fresh_mask=np.zeros((spec.rows, length), np.uint8),
    )


def _padding(
    spec: BatchSpec, length: int, rows: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """All-padding per-token arrays [R, ``length``] (R = ``rows``, default ``spec.rows``):
    tokens (int32), loss mask and behavior log-probs (float32), routing [R, T, L, K] of
    ``spec.routing_dtype`` (None without routing)."""
    R, T = spec.rows if rows is None else rows, length
    routing = None
    if spec.routing_lk is not None:
        L, K = spec.routing_lk
        # Padding positions replay a valid, duplicate-free expert set; they are masked anyway.
        ids = np.arange(K, dtype=spec.routing_dtype)
        routing = np.broadcast_to(ids, (R, T, L, K)).copy()
    zeros = np.zeros((R, T), np.float32)
    return np.zeros((R, T), np.int32), zeros, zeros.copy(), routing


def _fill_row(
    row: int,
    traj: Trajectory,
    spec: BatchSpec,
    tokens: np.ndarray,
    mask: np.ndarray,
    behavior: np.ndarray,
    routing: np.ndarray | None,
) -> None:
    """Writes one trajectory into row ``row`` (its per-token fields line up: it is a record).
    Observation tokens get loss mask 0 and behavior log-prob 0, and keep their recorded
    routing (R3 replays every position)."""
    p, c = len(traj.prompt_ids), len(traj.completion_ids)
    if p + c > spec.seq_len:
        raise ValueError(f"trajectory of {p} + {c} tokens exceeds seq_len {spec.seq_len}")
    generated = traj.generated
    tokens[row, :p] = traj.prompt_ids
    tokens[row, p : p + c] = traj.completion_ids
    mask[row, p : p + c] = generated
    behavior[row, p : p + c] = np.where(generated, traj.behavior_logprobs, 0.0)
    if routing is not None:
        ids = traj.routing
        if ids is None or ids.shape[1:] != routing.shape[2:]:
            raise ValueError(
                f"routing of shape {None if ids is None else ids.shape} does not fit "
                f"[T, L, K] = {routing.shape[1:]}"
            )
        routing[row, : ids.shape[0]] = ids
