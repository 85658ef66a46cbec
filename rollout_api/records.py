"""Plain typed records of the wire: a trajectory and a group as frozen dataclasses of numpy arrays.

Both ends hold these, never the proto messages: the server builds them from the engine's arrays
and converts them with `to_proto` where a finished group is queued; the trainer gets them from
`decode_group`, where a group is pulled. Those two functions are the only places that read or
write `rollout_pb2.Group` / `Trajectory` field by field (docs/DESIGN.md §6.2, §7.1).

A record is well formed by construction (`__post_init__` checks dtypes and that the per-token
fields line up); `decode_group` adds what depends on the trainer's model (`GroupLimits`: token
ids inside the vocabulary, routing ids inside the experts with the model's (L, K)), once per
group, and raises `InvalidGroupError` naming what is wrong. The trainer turns that error into an
`InvalidGroup` (`decode_pulled`), which it counts as invalid and rejects, so the server
generates a replacement.

One validation per trajectory per process, where it enters (docs/DESIGN.md §6.2): on the
server, when the engine's arrays become a record (`to_proto` checks no value again); on the
trainer, in `decode_group` (the wire's checks, the record's, then the limits'; batching
validates no value again). The per-token arrays travel packed (`PackedArray`: one little-endian
buffer each, `pack_array` / `unpack_array`), never as a Python object per token; a message of an
older server (the repeated fields) still decodes. The texts (`prompt_text`, `answer`,
`completion_text`) are in the queued message but leave the server only for a Pull that asks for
them (`PullRequest.include_texts`, `strip_texts`): the trainer reads none.

Multi-turn trajectories (docs/DESIGN.md §6.2): `Trajectory.loss_mask` marks which completion
tokens the policy generated (True) and which the environment inserted (observation tokens,
False). The per-token fields keep one entry per completion token, and the values of the
behavior log-prob, version and kept count at inserted positions are unspecified: nothing here
checks them (a garbage one never makes a group invalid), and the trainer never reads them
(`train.batching`). The token ids of inserted tokens are real context and are checked, and so
is their routing: the server's cache extension records it and R3 replays it.

Shapes: P prompt tokens (BOS included), C completion tokens, T = P + C positions, L MoE layers,
K experts per token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from rollout_api.proto import rollout_pb2
from rollout_api.routing_codec import decode_routing, encode_routing

# finish_reason of a record <-> the proto enum; "" is unspecified (or a reason this version of
# the wire does not know: a newer server's reason is not an error). "stop": a stop id ended the
# completion (any of rollout.stop_token_ids, the wire's FINISH_REASON_EOS); "length": a limit did.
_FINISH_TO_PROTO = {
    "": rollout_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": rollout_pb2.FINISH_REASON_EOS,
    "length": rollout_pb2.FINISH_REASON_LENGTH,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
_ROUTING_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


class InvalidGroupError(ValueError):
    """A pulled group that cannot be trained; the message names the group and what is wrong."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupLimits:
    """What a pulled group must fit: the trainer's model.

    Attributes:
      vocab_size: token ids must be in [0, vocab_size).
      num_experts: routing ids must be in [0, num_experts).
      routing_lk: (L, K) of the routing the trainer replays; None = it replays none, and the
        routing is not decoded (the records carry None).
    """

    vocab_size: int
    num_experts: int
    routing_lk: tuple[int, int] | None


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Trajectory:
    """One sampled completion of a prompt.

    Attributes:
      prompt_ids: int32 [P], P >= 1, exactly the tokenizer's prompt ids (BOS included).
      completion_ids: int32 [C], the stop id included when `finish_reason` is "stop".
      behavior_logprobs: float32 [C], finite at generated tokens: the sampler's log-prob of each
        completion token.
      versions: int64 [C], the weights version that produced each completion token.
      routing: uint8 or uint16 [P + C, L, K] expert ids of every position, or None.
      kept_counts: int32 [C], per completion token how many tokens the sampler's top-k / top-p
        truncation kept (>= 1 at generated tokens), or None: no truncation (the behavior
        log-probs are over the whole sampleable vocabulary).
      loss_mask: bool [C], True where the policy generated the completion token, False where
        the environment inserted it (a multi-turn observation, or the end-of-turn tokens that
        close a turn cut at the token limit); the first completion token is generated. None =
        every completion token generated (single-turn). At False positions the values of
        `behavior_logprobs`, `versions` and `kept_counts` are unspecified; the routing is the
        one the server's cache extension recorded for the inserted token (replayed by R3).
      response_formats: constrained decoding (`response_format`, docs/DESIGN.md §6.6): the
        canonical format strings (`sat_jax.json_mask.parse_response_format`) some completion
        tokens were sampled under; () = none.
      format_index: int32 [C] with `response_formats`: 0 where the token was sampled freely,
        i >= 1 where under `response_formats[i - 1]` (a run of one index is one reply, its
        automaton started at the run's first token); 0 at inserted tokens. None = all free.
      reward: finite.
      finish_reason: "stop", "length" or "" (unspecified). A multi-turn episode's is "length"
        when any of its turns was cut by a limit (`max_new_tokens` or the episode's token
        budget): the trainer's one test of an overlong trajectory.
      completion_text: the completion decoded (special tokens skipped).

    Raises:
      ValueError: a field of the wrong dtype or rank, per-token fields of different lengths,
        an empty prompt, a non-finite log-prob or reward, an unknown finish reason, a loss mask
        whose first entry is False.
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behavior_logprobs: np.ndarray
    versions: np.ndarray
    routing: np.ndarray | None = None
    kept_counts: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    reward: float = 0.0
    finish_reason: str = ""
    completion_text: str = ""
    response_formats: tuple[str, ...] = ()
    format_index: np.ndarray | None = None

    def __post_init__(self):
        _check_vector("prompt_ids", self.prompt_ids, np.int32)
        _check_vector("completion_ids", self.completion_ids, np.int32)
        _check_vector("behavior_logprobs", self.behavior_logprobs, np.float32)
        _check_vector("versions", self.versions, np.int64)
        if self.prompt_ids.size == 0:
            raise ValueError("prompt_ids is empty (a trajectory starts with its prompt)")
        c = self.completion_ids.size
        if self.behavior_logprobs.size != c or self.versions.size != c:
            raise ValueError(
                f"{c} completion tokens but {self.behavior_logprobs.size} behavior log-probs and "
                f"{self.versions.size} versions"
            )
        if self.loss_mask is not None:
            _check_vector("loss_mask", self.loss_mask, np.bool_)
            if self.loss_mask.size != c:
                raise ValueError(
                    f"{c} completion tokens but {self.loss_mask.size} loss mask entries"
                )
            if c and not self.loss_mask[0]:
                raise ValueError(
                    "loss_mask starts with an inserted token (the first completion token is "
                    "generated by the policy)"
                )
        generated = _at_generated(self.loss_mask)
        if self.kept_counts is not None:
            _check_vector("kept_counts", self.kept_counts, np.int32)
            if self.kept_counts.size != c:
                raise ValueError(f"{c} completion tokens but {self.kept_counts.size} kept counts")
            kept = generated(self.kept_counts)
            if kept.size and kept.min() < 1:
                raise ValueError(f"a kept count is {int(kept.min())}, must be >= 1")
        _check_formats(self.response_formats, self.format_index, self.generated)
        if not np.isfinite(generated(self.behavior_logprobs)).all():
            raise ValueError("a behavior log-prob is not finite")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward {self.reward} is not finite")
        if self.finish_reason not in _FINISH_TO_PROTO:
            raise ValueError(f"unknown finish_reason {self.finish_reason!r}")
        if self.routing is not None:
            r = self.routing
            if not isinstance(r, np.ndarray) or r.ndim != 3 or r.dtype not in _ROUTING_DTYPES:
                raise ValueError(
                    f"routing must be a uint8/uint16 array [P + C, L, K], got "
                    f"{getattr(r, 'dtype', type(r).__name__)} of shape {np.shape(r)}"
                )
            if r.shape[0] != self.num_tokens:
                raise ValueError(
                    f"routing has {r.shape[0]} positions, expected P + C = "
                    f"{self.prompt_ids.size} + {c}"
                )

    @property
    def num_tokens(self) -> int:
        """T = P + C, the positions of the trajectory."""
        return self.prompt_ids.size + self.completion_ids.size

    @property
    def generated(self) -> np.ndarray:
        """bool [C]: the completion tokens the policy generated (`loss_mask`, all True when
        None)."""
        if self.loss_mask is None:
            return np.ones(self.completion_ids.size, bool)
        return self.loss_mask

    @property
    def num_generated(self) -> int:
        """How many completion tokens the policy generated."""
        c = self.completion_ids.size
        return c if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))


def _check_formats(formats: tuple[str, ...], index: np.ndarray | None, generated: np.ndarray):
    """Raises ValueError unless the format index lines up with the completion, names a format
    of `formats` (1-based) and is 0 at inserted tokens."""
    if index is None:
        if formats:
            raise ValueError(f"{len(formats)} response formats but no format index")
        return
    _check_vector("format_index", index, np.int32)
    if index.size != generated.size:
        raise ValueError(f"{generated.size} completion tokens but {index.size} format indices")
    if index.size and (index.min() < 0 or index.max() > len(formats)):
        raise ValueError(
            f"a format index outside [0, {len(formats)}] (the response formats, 1-based)"
        )
    if (index[~generated] != 0).any():
        raise ValueError("an inserted token has a response format (only generated ones do)")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Group:
    """The trajectories of one prompt, as the server finished them.

    Attributes:
      group_id: the server's id of the group.
      prompt_id: the prompt's stable id (across restarts).
      prompt_text, answer: the prompt and its reference answer.
      server_id: the random id of the server's persisted state.
      trajectories: the group's samples.
      sessions: forked HTTP sessions (docs/DESIGN.md §6.6): per trajectory, the index of the
        sample it is a segment of (non-decreasing from 0 by steps of at most 1; a session's
        segments share its reward); () = one trajectory per sample.

    Raises:
      ValueError: `sessions` of another length than `trajectories`, or not 0, ... in order.
    """

    group_id: int
    prompt_id: str
    prompt_text: str = ""
    answer: str = ""
    server_id: str = ""
    trajectories: tuple[Trajectory, ...] = ()
    sessions: tuple[int, ...] = ()

    def __post_init__(self):
        if self.sessions:
            check_sessions(self.sessions, len(self.trajectories))

    @property
    def session_ids(self) -> np.ndarray:
        """int [len(trajectories)]: each trajectory's sample (0, 1, ... without forks)."""
        if self.sessions:
            return np.asarray(self.sessions, np.int64)
        return np.arange(len(self.trajectories))

    @property
    def key(self) -> str:
        """The group's name, unique across servers and their restarts: "server_id/group_id"."""
        return group_key(self.server_id, self.group_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InvalidGroup:
    """A pulled group that `decode_group` refused: what the trainer needs to count, log and
    reject it.

    Attributes:
      group_id, prompt_id, server_id: as in the message.
      problem: what is wrong (the `InvalidGroupError`'s message).
    """

    group_id: int
    prompt_id: str
    server_id: str
    problem: str

    @property
    def key(self) -> str:
        """As `Group.key`."""
        return group_key(self.server_id, self.group_id)


def check_sessions(sessions: Sequence[int], trajectories: int) -> None:
    """Raises ValueError unless `sessions` (a group's, `Group.sessions`) has one entry per
    trajectory, starts at 0 and steps by 0 or 1."""
    if len(sessions) != trajectories:
        raise ValueError(f"{len(sessions)} sessions for {trajectories} trajectories")
    steps = np.diff(np.asarray([0, *sessions]))
    if sessions[0] != 0 or ((steps != 0) & (steps != 1)).any():
        raise ValueError(f"sessions must count 0, 1, ... in order, got {list(sessions)}")


def group_key(server_id: str, group_id: int) -> str:
    """The name of a group, unique across servers and their restarts: "server_id/group_id"."""
    return f"{server_id}/{group_id}"


def to_proto(group: Group) -> rollout_pb2.Group:
    """The `rollout_pb2.Group` message of a record (the server's one conversion): the per-token
    arrays packed (`PackedArray`, one buffer each; the routing by `routing_codec`), the texts
    included (`strip_texts` takes them out of a reply that did not ask for them). The record was
    checked when it was built; no value is checked again here."""
    return rollout_pb2.Group(
        group_id=group.group_id,
        prompt_id=group.prompt_id,
        prompt_text=group.prompt_text,
        answer=group.answer,
        server_id=group.server_id,
        trajectories=[_trajectory_to_proto(t) for t in group.trajectories],
        sessions=group.sessions,
    )


def _trajectory_to_proto(t: Trajectory) -> rollout_pb2.Trajectory:
    return rollout_pb2.Trajectory(
        prompt_ids_packed=pack_array(t.prompt_ids),
        completion_ids_packed=pack_array(t.completion_ids),
        behavior_logprobs_packed=pack_array(t.behavior_logprobs),
        versions_packed=pack_array(t.versions),
        routing=None if t.routing is None else encode_routing(t.routing),
        kept_counts_packed=None if t.kept_counts is None else pack_array(t.kept_counts),
        loss_mask_packed=None if t.loss_mask is None else pack_array(t.loss_mask),
        reward=t.reward,
        finish_reason=_FINISH_TO_PROTO[t.finish_reason],
        completion_text=t.completion_text,
        response_formats=t.response_formats,
        format_index_packed=None if t.format_index is None else pack_array(t.format_index),
    )


# An integer array is packed in the first of these (lowest, highest, wire dtype, name) that holds
# its values; a reader accepts, for each field, only the wire dtypes its values' dtype holds whole
# (no wrap-around on the way in). Built once: numpy's dtype names and limits are slow to ask for.
_NARROW = tuple(
    (int(np.iinfo(d).min), int(np.iinfo(d).max), np.dtype(d).newbyteorder("<"), np.dtype(d).name)
    for d in (np.uint8, np.uint16, np.int32, np.int64)
)
_WIRE = {n: np.dtype(n).newbyteorder("<") for n in ("uint8", "uint16", "uint32", "int32", "int64")}
_WIRE["float32"] = np.dtype("<f4")
_WIRE_DTYPES = {  # keyed by the scalar type (hashing a np.dtype is slow)
    np.int32: ("uint8", "uint16", "int32"),
    np.int64: ("uint8", "uint16", "uint32", "int32", "int64"),
    np.float32: ("float32",),
    np.uint8: ("uint8",),
}


def pack_array(values: np.ndarray) -> rollout_pb2.PackedArray:
    """The `PackedArray` of a 1-D array: float32 as it is, bool as uint8, integers in the
    narrowest of uint8, uint16, int32 and int64 that holds them; little-endian bytes."""
    values = np.asarray(values)
    kind = values.dtype.kind
    if kind == "b":
        wire, name = _WIRE["uint8"], "uint8"
    elif kind in "iu":
        lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
        wire, name = next((w, n) for low, high, w, n in _NARROW if low <= lo and hi <= high)
    else:
        wire, name = values.dtype.newbyteorder("<"), values.dtype.name
    data = np.ascontiguousarray(values, dtype=wire).tobytes()
    return rollout_pb2.PackedArray(data=data, dtype=name)


def unpack_array(packed: rollout_pb2.PackedArray, dtype: type) -> np.ndarray:
    """The 1-D array of `dtype` (int32, int64, float32 or uint8) a `PackedArray` carries, fresh.

    Raises:
      ValueError: a wire dtype that does not hold `dtype`'s values whole (e.g. int64 for
        int32 ids), or a byte count that is not a whole number of items.
    """
    allowed = _WIRE_DTYPES.get(dtype) or _WIRE_DTYPES[np.dtype(dtype).type]
    name = packed.dtype
    if name not in allowed:
        raise ValueError(
            f"packed dtype {name!r} for {np.dtype(dtype)} values (expected one of "
            f"{', '.join(allowed)})"
        )
    wire = _WIRE[name]
    data = packed.data
    if len(data) % wire.itemsize:
        raise ValueError(f"{len(data)} bytes are not a whole number of {name} items")
    return np.frombuffer(data, wire).astype(dtype)


def strip_texts(groups: Iterable[rollout_pb2.Group]) -> None:
    """Empties the texts of group messages (a reply's copies): `prompt_text`, `answer` and every
    `completion_text`, which the trainer never reads (`PullRequest.include_texts` keeps them)."""
    for g in groups:
        g.ClearField("prompt_text")
        g.ClearField("answer")
        for t in g.trajectories:
            t.ClearField("completion_text")


def decode_group(message: rollout_pb2.Group, limits: GroupLimits | None = None) -> Group:
    """The record of a pulled group, validated (the trainer's one conversion).

    Args:
      message: the group as pulled.
      limits: the trainer's model; None = check only that the group is well formed (per-token
        lengths, dtypes, a routing that decodes to [P + C, L, K]).

    Returns:
      The `Group`, its arrays fresh (they share no memory with `message`).

    Raises:
      InvalidGroupError: naming the group, the trajectory and what is wrong: per-token fields of
        different lengths, an empty prompt, a non-finite log-prob (of a generated token) or
        reward, a `loss_mask` that is not a mask of the completion (`decode_loss_mask`); with
        `limits`, a token id outside [0, vocab_size), a missing or unreadable routing, a routing
        of another (L, K), a routing id outside [0, num_experts) at any position (the trainer
        replays them all: prompt, generated and inserted tokens), a kept count of a generated
        token over the vocabulary.
    """
    trajectories = []
    for i, t in enumerate(message.trajectories):
        try:
            trajectories.append(_decode_trajectory(t, limits))
        except ValueError as e:
            raise InvalidGroupError(
                f"group {group_key(message.server_id, message.group_id)}, trajectory {i}: {e}"
            ) from None
    sessions = tuple(message.sessions)
    if sessions:
        try:
            check_sessions(sessions, len(trajectories))
        except ValueError as e:
            name = group_key(message.server_id, message.group_id)
            raise InvalidGroupError(f"group {name}: {e}") from None
    return Group(
        group_id=message.group_id,
        prompt_id=message.prompt_id,
        prompt_text=message.prompt_text,
        answer=message.answer,
        server_id=message.server_id,
        trajectories=tuple(trajectories),
        sessions=sessions,
    )


def decode_pulled(
    messages: Iterable[rollout_pb2.Group], limits: GroupLimits | None = None
) -> list[Group | InvalidGroup]:
    """`decode_group` of each pulled message, in order; a group it refuses becomes an
    `InvalidGroup` carrying the error's message."""
    out: list[Group | InvalidGroup] = []
    for m in messages:
        try:
            out.append(decode_group(m, limits))
        except InvalidGroupError as e:
            out.append(
                InvalidGroup(
                    group_id=m.group_id,
                    prompt_id=m.prompt_id,
                    server_id=m.server_id,
                    problem=str(e),
                )
            )
    return out


def _per_token(t: rollout_pb2.Trajectory, name: str, dtype: type) -> np.ndarray | None:
    """A per-token field of a trajectory message: its packed form when set, else the repeated
    one (an older server's); None when neither carries a value."""
    packed = f"{name}_packed"
    if t.HasField(packed):
        try:
            return unpack_array(getattr(t, packed), dtype)
        except ValueError as e:
            raise ValueError(f"unreadable {name} ({e})") from None
    values = getattr(t, name)
    return np.array(values, dtype) if len(values) else None


def _decode_trajectory(t: rollout_pb2.Trajectory, limits: GroupLimits | None) -> Trajectory:
    """One trajectory's record, validated once: the wire's own checks (the mask's values, the
    routing's bytes), the record's (`Trajectory.__post_init__`: lengths, dtypes, finite values),
    then the limits'. ValueError names what is wrong (without the group)."""
    empty = lambda dtype: np.zeros(0, dtype)
    prompt_ids = _per_token(t, "prompt_ids", np.int32)
    completion_ids = _per_token(t, "completion_ids", np.int32)
    completion_ids = empty(np.int32) if completion_ids is None else completion_ids
    mask = _per_token(t, "loss_mask", np.int64)
    loss_mask = None if mask is None else decode_loss_mask(mask, completion_ids.size)
    routing = None
    if t.HasField("routing") and (limits is None or limits.routing_lk is not None):
        try:
            routing = decode_routing(t.routing)
        except ValueError as e:
            raise ValueError(f"unreadable routing ({e})") from None
    behavior = _per_token(t, "behavior_logprobs", np.float32)
    versions = _per_token(t, "versions", np.int64)
    finish = int(t.finish_reason)
    formats = None
    if t.HasField("format_index_packed"):
        try:
            formats = unpack_array(t.format_index_packed, np.int32)
        except ValueError as e:
            raise ValueError(f"unreadable format_index ({e})") from None
    record = Trajectory(
        prompt_ids=empty(np.int32) if prompt_ids is None else prompt_ids,
        completion_ids=completion_ids,
        behavior_logprobs=empty(np.float32) if behavior is None else behavior,
        versions=empty(np.int64) if versions is None else versions,
        routing=routing,
        kept_counts=_per_token(t, "kept_counts", np.int32),
        loss_mask=loss_mask,
        reward=float(t.reward),
        finish_reason=_FINISH_FROM_PROTO.get(finish, ""),
        completion_text=t.completion_text,
        response_formats=tuple(t.response_formats),
        format_index=formats,
    )
    if limits is not None:
        _check_limits(record, limits)
    return record


def _check_limits(t: Trajectory, limits: GroupLimits) -> None:
    """What a well-formed record must also fit to be trained by the trainer's model."""
    for name, ids in (("prompt", t.prompt_ids), ("completion", t.completion_ids)):
        _check_range(f"{name} token id", ids, limits.vocab_size, "the vocabulary")
    if limits.routing_lk is not None:
        if t.routing is None:
            raise ValueError("no routing (the trainer replays routing)")
        lk = tuple(limits.routing_lk)
        if t.routing.shape[1:] != lk:
            raise ValueError(f"routing of (L, K) = {t.routing.shape[1:]}, expected {lk}")
        # Every position is replayed, inserted (observation) tokens too.
        _check_range("routing id", t.routing, limits.num_experts, "the experts")
    if t.kept_counts is not None:
        most = _at_generated(t.loss_mask)(t.kept_counts).max(initial=1)
        if most > limits.vocab_size:
            raise ValueError(f"a kept count {int(most)} exceeds the vocabulary {limits.vocab_size}")


def encode_loss_mask(loss_mask: np.ndarray | None) -> list[int]:
    """The wire's `loss_mask` of a record's: one 0/1 per completion token; [] for None (every
    token generated, as single-turn)."""
    return [] if loss_mask is None else np.asarray(loss_mask, bool).astype(np.uint8).tolist()


def decode_loss_mask(values: Iterable[int], completion_tokens: int) -> np.ndarray | None:
    """The loss mask of the wire's `loss_mask` (`encode_loss_mask`'s inverse).

    Args:
      values: one 0/1 per completion token (1 = generated, 0 = inserted), or none.
      completion_tokens: C, the trajectory's completion length.

    Returns:
      bool [C], or None when `values` is empty (every completion token generated).

    Raises:
      ValueError: a value other than 0 and 1, a length other than C, or a first completion
        token that is not generated (an episode starts with the policy's turn).
    """
    mask = values if isinstance(values, np.ndarray) else np.array(list(values), np.int64)
    if mask.size == 0:
        return None
    if mask.size != completion_tokens:
        raise ValueError(
            f"loss_mask has {mask.size} entries, expected one per completion token "
            f"({completion_tokens})"
        )
    bad = np.flatnonzero((mask != 0) & (mask != 1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"loss_mask[{i}] is {int(mask[i])}; entries must be 0 or 1")
    if mask[0] != 1:
        raise ValueError("loss_mask[0] is 0: the first completion token is the policy's")
    return mask.astype(bool)


def _at_generated(loss_mask: np.ndarray | None):
    """A per-token array's values at the generated tokens (the array itself without a mask)."""
    if loss_mask is None:
        return lambda x: x
    return lambda x: x[loss_mask]


def _check_vector(name: str, value: object, dtype: type) -> None:
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype != dtype:
        raise ValueError(
            f"{name} must be a 1-D {np.dtype(dtype)} array, got "
            f"{getattr(value, 'dtype', type(value).__name__)} of shape {np.shape(value)}"
        )


def _check_range(what: str, ids: np.ndarray, upper: int, of: str) -> None:
    """Raises ValueError naming the first of `ids` outside [0, upper)."""
    if ids.size == 0:
        return
    if ids.min() < 0 or ids.max() >= upper:
        bad = ids[(ids < 0) | (ids >= upper)].flat[0]
        raise ValueError(f"{what} {int(bad)} outside [0, {upper}) ({of})")
