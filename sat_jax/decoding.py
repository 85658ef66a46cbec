"""The KV-cache decoding core: sampling, prefill, insert into slots, one decode step for every slot.

One implementation serves both the rollout server (``rollout_server.engine.MoEEngine`` adapts it
to JetStream's Engine API and adds weight swaps) and evaluation (``sat_jax.completions``, batched
over the slots, used by ``sat-eval`` and the trainer's periodic evaluation), so an evaluation
samples exactly as the server does (docs/DESIGN.md §1, §6.1).

Per generated token, ``DecodeCore.generate`` returns, in int32 columns of one [B, 7 + L·K] array
(one host copy per step): the token, whether it is valid (the slot was active), the slot's
completion length, the behavior log-prob bit-cast from float32, the weights version whose logits
the token was sampled from, how many tokens the top-k / top-p truncation kept (the trainer's
truncation replay, docs/DESIGN.md §2), the slot's segment (how many times ``extend`` has appended
tokens to it since its insert), and the token's top-k expert ids per MoE layer (computed when the
token is fed back through the model in the same step). ``unpack_step`` reads it on the host.

Multi-turn episodes continue in their slot: ``extend`` rewinds a slot's cache to the end of a turn
and appends the environment's observation tokens in one chunked forward (only the new tokens are
computed; the cache before them is kept), so decoding goes on from the observation's last logits.
Steps a slot ran between the end of its turn and the extension are garbage; the segment column
tells a consumer which steps come after the extension.

A prefill emits no token: the prefix keeps the last prompt position's logits and the next
``generate`` samples from them. So a token's version is the version of the params that produced its
logits. Sampling is restricted to ``sampleable_v`` (every other id gets -inf), and per slot to an
optional row of allowed ids (``generate(allowed_bv=...)``: constrained decoding); the behavior
log-prob is under that restricted, temperature/top-k/top-p-adjusted distribution.

Dimension letters: B slots, P padded prompt length, S cache positions, V vocab, L MoE layers,
K experts per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding

from sat_jax import quant, sharding
from sat_jax.config import RolloutConfig
from sat_jax.model import KVCache, ModelConfig, empty_cache

log = logging.getLogger(__name__)

# The KV cache's positions per slot are a multiple of this (`DecodeCore.cache_positions`).
CACHE_POSITION_MULTIPLE = 16
# Column layout of one generate step's output.
TOKEN_COL, VALID_COL, LENGTH_COL, LOGP_COL, VERSION_COL, KEPT_COL, SEGMENT_COL, ROUTING_COL = range(
    8
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """temperature > 0; top_k = 0 and top_p = 1 disable truncation (top_k = 1 is greedy)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the distribution (then each token's kept count matters)."""
        return self.top_k > 0 or self.top_p < 1.0

    @classmethod
    def from_rollout(cls, cfg: RolloutConfig) -> SamplingConfig:
        """The sampler of an experiment's `RolloutConfig` (where its defaults live)."""
        return cls(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sampling_logprobs(logits_bv: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """[B, V] float32 log-probs of the sampling distribution (-inf outside the kept set).

    logits / temperature, truncated to the top-k tokens and then to the smallest top-p nucleus,
    renormalized: the behavior policy μ of docs/DESIGN.md §2 (with top_p = 1 and top_k = 0 it is
    log_softmax(logits / T)).
    """
    x_bv = logits_bv.astype(jnp.float32) / cfg.temperature
    vocab = x_bv.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth_b1 = jax.lax.top_k(x_bv, cfg.top_k)[0][:, -1:]
        x_bv = jnp.where(x_bv < kth_b1, -jnp.inf, x_bv)
    if cfg.top_p < 1.0:
        sorted_bv = jnp.sort(x_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass strictly
        # before it is below top_p (the most likely token always stays).
        keep_bv = mass_before_bv < cfg.top_p
        threshold_b1 = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
        x_bv = jnp.where(x_bv < threshold_b1, -jnp.inf, x_bv)
    return jax.nn.log_softmax(x_bv, axis=-1)


def sample(
    logits_bv: jax.Array, key: jax.Array, cfg: SamplingConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens [B] int32, their log-probs [B] float32, the
    kept set's size [B] int32: the tokens of finite log-prob, what a truncation replay needs)."""
    logp_bv = sampling_logprobs(logits_bv, cfg)
    tokens_b = jax.random.categorical(key, logp_bv, axis=-1).astype(jnp.int32)
    kept_b = jnp.sum(jnp.isfinite(logp_bv), axis=-1, dtype=jnp.int32)
    return tokens_b, jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0], kept_b


@struct.dataclass
class Prefix:
    """A prefilled prompt (batch 1): cache of P positions, last logits, prompt routing."""

    cache: KVCache
    logits_v: jax.Array
    routing_plk: jax.Array
    true_length: jax.Array
    version: jax.Array
    prompt_ids: np.ndarray
    # The request's constrained-decoding format (`sat_jax.json_mask`), carried from the
    # engine's prefill to its insert; static, stripped before the jitted insert.
    response_format: str | None = struct.field(pytree_node=False, default=None)


@struct.dataclass
class DecodeState:
    """All slots: the KV cache, each slot's pending next-token logits and their version, its
    completion length (generated and inserted tokens; ``max_decode_length`` = exhausted) and its
    segment (extensions since the insert)."""

    cache: KVCache
    logits_bv: jax.Array
    logits_version_b: jax.Array
    generated_b: jax.Array
    key: jax.Array
    segment_b: jax.Array


class _Serialized:
    """A jitted function called under a lock (and, when ``wait``, finished inside it), traced,
    lowered and run with ``mesh`` as the ambient mesh (``jax.set_mesh``) when there is one, as
    the train step is; other attributes (``_cache_size``) are the jitted function's."""

    def __init__(
        self, fn: Any, lock: threading.Lock, wait: bool, mesh: jax.sharding.Mesh | None = None
    ):
        self.fn, self.lock, self.wait, self.mesh = fn, lock, wait, mesh

    def _ambient(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def __call__(self, *args: Any) -> Any:
        with self.lock, self._ambient():
            out = self.fn(*args)
            return jax.block_until_ready(out) if self.wait else out

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """``jit(...).lower`` under the same ambient mesh as a call."""
        with self._ambient():
            return self.fn.lower(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


class DecodeCore:
    """Jitted prefill / insert / generate of a ``Transformer`` over a fixed number of slots.

    Params are arguments of every call (never captured), so new weights of the same shapes and
    shardings reuse the compiled executables. ``generate`` attends over ``decode_window()``
    positions (a power of two above the longest active slot; ``generate_step`` takes the window
    explicitly), tracked on the host for the last ``init_state``'s slots. Device calls are
    serialized (see ``_Serialized``).

    Args:
      graphdef: the model's ``nnx.GraphDef``.
      config: its ``ModelConfig``.
      slots: concurrent decodes (B).
      max_prefill_length: longest (padded) prompt.
      max_decode_length: most completion tokens per request (a multi-turn episode's generated
        and inserted tokens together); a slot stops there.
      sampling: temperature / top-k / top-p.
      sampleable_v: [V] bool, the ids sampling may produce.
      seed: sampling PRNG seed.
      mesh: shard the KV cache over this mesh (KV heads over ``tensor`` by the rules of
        ``sat_jax.sharding``); the params come in their own shardings (``param_shardings`` on the
        same mesh) and the computation follows them. Every program is traced with it as the
        ambient mesh (``jax.set_mesh``), as the train step is, so the model's "auto" paths take
        the same TPU kernels as the trainer (megablox ``gmm`` for the experts, per shard;
        docs/DESIGN.md §6.1). None: whatever the params' devices are (one device: a process
        with several TPU devices and no mesh cannot place the kernels and keeps ``ragged_dot``,
        which is logged as a warning).
      kv_cache_dtype: "bfloat16" (the cache in the serving dtype) or "int8" / "fp8": the cache
        stored 8-bit with a float32 scale per position and KV head (`sat_jax.quant`), written in
        place and read dequantized; a prompt's prefill attends over its keys and values as the
        cache holds them, so every token is sampled from the model the trainer can replay
        (``Transformer.forward(kv_cache_dtype=...)``).

    Params may hold `sat_jax.quant.QTensor` leaves (8-bit served weights): every program
    dequantizes them on use (`quant.dequantize_params`), before the model runs.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        config: ModelConfig,
        *,
        slots: int,
        max_prefill_length: int,
        max_decode_length: int,
        sampling: SamplingConfig,
        sampleable_v: np.ndarray,
        seed: int = 0,
        mesh: jax.sharding.Mesh | None = None,
        kv_cache_dtype: str = "bfloat16",
    ):
        quant.check_format(kv_cache_dtype, "kv_cache_dtype")
        if np.shape(sampleable_v) != (config.vocab_size,):
            raise ValueError(
                f"sampleable_v has shape {np.shape(sampleable_v)}, expected ({config.vocab_size},)"
            )
        self.graphdef = graphdef
        self.config = config
        self.kv_cache_dtype = kv_cache_dtype
        self.slots = slots
        self.max_prefill_length = max_prefill_length
        self.max_decode_length = max_decode_length
        self.cache_length = max_prefill_length + max_decode_length + 1
        # Positions stored per slot: the cache length rounded up to a multiple of 16 (the TPU's
        # bfloat16 sublane tile), so the decode step's in-place write sees the cache as rows of
        # [L, B·S, G, H] without a relayout (`Transformer._trunk`). Programs attend over at most
        # `cache_length` positions; the others are never read.
        self.cache_positions = -(-self.cache_length // CACHE_POSITION_MULTIPLE) * (
            CACHE_POSITION_MULTIPLE
        )
        self.sampling = sampling
        self.sampleable_v = np.asarray(sampleable_v, bool)
        self.seed = seed
        self.mesh = mesh
        if mesh is None and config.dispatch == "auto" and _kernels_unplaceable():
            log.warning(
                "DecodeCore without a mesh on %d TPU devices: the experts run ragged_dot, not "
                "the trainer's megablox kernels; give it the server's mesh (server.mesh)",
                jax.device_count(),
            )
        # The last prefill, reused while the same prompt comes again under the same version (a
        # group's G samples arrive together): one prefill per group.
        self.prefill_calls = 0
        self.prefill_tokens = 0  # prompt tokens the real prefills computed
        self.extend_calls = 0
        self.extend_tokens = 0  # observation tokens the extensions computed
        self._last_prefill: tuple[tuple[bytes, int], Prefix] | None = None
        self._prefill_lock = threading.Lock()
        # Host-simulated devices run a sharded program's collectives as a rendezvous of the
        # devices' threads: two such programs dispatched from two threads (JetStream's prefill and
        # generate threads) can each hold some devices and wait forever for the others. So every
        # device call runs under one lock, and on CPU meshes of several devices it also waits
        # for its result inside the lock.
        self._device_lock = threading.Lock()
        self._wait_inside_lock = (
            mesh is not None and mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"
        )
        self.prefill = self._serialized(jax.jit(self._prefill))
        self._insert_step = self._serialized(jax.jit(self._insert, donate_argnums=(1,)))
        self.generate_step = self._serialized(
            jax.jit(self._generate, donate_argnums=(1,), static_argnums=(3,))
        )
        self._extend_step = self._serialized(jax.jit(self._extend, donate_argnums=(1,)))
        self._evict_step = self._serialized(
            jax.jit(
                lambda state, slot, segment: state.replace(
                    generated_b=state.generated_b.at[slot].set(self.max_decode_length),
                    segment_b=jnp.where(
                        segment < 0, state.segment_b, state.segment_b.at[slot].set(segment)
                    ),
                )
            )
        )
        # The host's copy of every slot's cache length and generated count (the device's, kept
        # by insert / evict / generate without a device read), to pick each step's window.
        self._lengths_b = np.zeros((slots,), np.int64)
        self._generated_b = np.full((slots,), max_decode_length, np.int64)

    def _serialized(self, fn: Any) -> _Serialized:
        return _Serialized(fn, self._device_lock, self._wait_inside_lock, self.mesh)

    def _shard_cache(self, cache: KVCache) -> KVCache:
        """The cache [L, B, S, G, H] with KV heads over the mesh's ``tensor`` axis (no-op
        without a mesh)."""
        if self.mesh is None:
            return cache
        axes = ("layers", None, "length", "kv_heads", "head_dim")

        def put(x: jax.Array) -> jax.Array:  # keys/values [L, B, S, G, H], scales [L, B, S, G]
            spec = sharding.logical_to_spec(axes[: x.ndim], shape=x.shape, mesh=self.mesh)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return cache.map_arrays(put)

    def _model(self, params: Any) -> Any:
        """The model of ``params``, 8-bit weights dequantized (`quant.dequantize_params`)."""
        return nnx.merge(self.graphdef, quant.dequantize_params(params))

    def _prefill(
        self, params: Any, tokens_p: jax.Array, true_length: jax.Array, version: jax.Array
    ) -> Prefix:
        model = self._model(params)
        p = tokens_p.shape[0]
        mask_1p = (jnp.arange(p) < true_length)[None]
        out = model.prefill(
            model.init_cache(1, p, self.kv_cache_dtype),
            tokens_p[None],
            mask_bt=mask_1p,
            return_routing=True,
        )
        return Prefix(
            cache=self._shard_cache(out.cache),
            logits_v=out.logits_btv[0, true_length - 1],
            routing_plk=out.routing_btlk[0],
            true_length=true_length,
            version=version,
            prompt_ids=np.zeros((0,), np.int32),
        )

    def _insert(self, prefix: Prefix, state: DecodeState, slot: jax.Array) -> DecodeState:
        c = state.cache
        new = prefix.cache.arrays()
        cache = c.replace(
            **{
                n: jax.lax.dynamic_update_slice(
                    x, new[n].astype(x.dtype), (0, slot) + (0,) * (x.ndim - 2)
                )
                for n, x in c.arrays().items()
            },
            lengths_b=c.lengths_b.at[slot].set(prefix.true_length),
        )
        return DecodeState(
            cache=self._shard_cache(cache),
            logits_bv=state.logits_bv.at[slot].set(prefix.logits_v),
            logits_version_b=state.logits_version_b.at[slot].set(prefix.version),
            generated_b=state.generated_b.at[slot].set(0),
            key=state.key,
            segment_b=state.segment_b.at[slot].set(0),
        )

    def _extend(
        self,
        params: Any,
        state: DecodeState,
        slot: jax.Array,
        tokens_t: jax.Array,
        n: jax.Array,
        start: jax.Array,
        generated: jax.Array,
        version: jax.Array,
        segment: jax.Array,
    ) -> tuple[DecodeState, jax.Array]:
        model = self._model(params)
        c = state.cache
        row = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=1)
        cache_1 = c.map_arrays(row).replace(lengths_b=start.reshape(1))
        mask_1t = (jnp.arange(tokens_t.shape[0]) < n)[None]
        out = model.extend(
            cache_1, tokens_t[None], mask_bt=mask_1t, return_routing=True, window=self.cache_length
        )
        put = lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, axis=1)
        new = out.cache.arrays()
        cache = c.replace(
            **{name: put(x, new[name]) for name, x in c.arrays().items()},
            lengths_b=c.lengths_b.at[slot].set(start + n),
        )
        new_state = DecodeState(
            cache=self._shard_cache(cache),
            logits_bv=state.logits_bv.at[slot].set(out.logits_btv[0, n - 1]),
            logits_version_b=state.logits_version_b.at[slot].set(version),
            generated_b=state.generated_b.at[slot].set(generated),
            key=state.key,
            segment_b=state.segment_b.at[slot].set(segment),
        )
        return new_state, out.routing_btlk[0].astype(jnp.int32)

    def _sample(
        self, logits_bv: jax.Array, key: jax.Array, positions_b: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`sample` of every slot's next token (which goes to cache position ``positions_b``);
        a subclass may choose tokens another way (tests force scripted completions)."""
        del positions_b
        return sample(logits_bv, key, self.sampling)

    def _generate(
        self,
        params: Any,
        state: DecodeState,
        version: jax.Array,
        window: int,
        allowed_bv: jax.Array | None = None,
    ) -> tuple[DecodeState, jax.Array]:
        key, step_key = jax.random.split(state.key)
        sampleable = self.sampleable_v if allowed_bv is None else allowed_bv & self.sampleable_v
        logits_bv = jnp.where(sampleable, state.logits_bv, -jnp.inf)
        tokens_b, logp_b, kept_b = self._sample(logits_bv, step_key, state.cache.lengths_b)
        active_b = state.generated_b < self.max_decode_length
        model = self._model(params)
        out = model.decode_step(
            state.cache, tokens_b, active_b=active_b, return_routing=True, window=window
        )
        generated_b = state.generated_b + active_b.astype(jnp.int32)
        b = tokens_b.shape[0]
        columns = [
            tokens_b[:, None],
            active_b.astype(jnp.int32)[:, None],
            generated_b[:, None],
            jax.lax.bitcast_convert_type(logp_b, jnp.int32)[:, None],
            state.logits_version_b[:, None],
            kept_b[:, None],
            state.segment_b[:, None],
            out.routing_blk.astype(jnp.int32).reshape(b, -1),
        ]
        new_state = DecodeState(
            cache=self._shard_cache(out.cache),
            logits_bv=out.logits_bv,
            logits_version_b=jnp.where(active_b, version, state.logits_version_b),
            generated_b=generated_b,
            key=key,
            segment_b=state.segment_b,
        )
        return new_state, jnp.concatenate(columns, axis=1)

    def insert(self, prefix: Prefix, state: DecodeState, slot: jax.Array | int) -> DecodeState:
        """Writes a prefix into ``slot`` of ``state`` (donated)."""
        length = int(prefix.true_length)
        state = self._insert_step(prefix, state, jnp.int32(slot))
        self._lengths_b[int(slot)], self._generated_b[int(slot)] = length, 0
        return state

    def extend(
        self,
        params: Any,
        state: DecodeState,
        slot: int,
        tokens: Sequence[int],
        *,
        start: int,
        generated: int,
        version: int,
        segment: int,
    ) -> tuple[DecodeState, jax.Array]:
        """Continues ``slot`` after inserted tokens: its cache is cut back to ``start`` positions
        (the end of the turn; what later steps wrote is dropped) and ``tokens`` are appended in
        one chunked forward under ``params``, whose logits after the last token are what the
        slot samples next (as of ``version``). ``state`` is donated.

        Returns:
          The new state and the inserted tokens' routing ids [n, L, K] int32 (on device), as
          the chunked forward routed them: what the trainer replays at those positions, like
          ``Prefix.routing_plk`` for a prompt and the step output's routing for a generated
          token.

        Args:
          slot: the slot (it must hold a request: the caller tracks that).
          tokens: the inserted ids (at least one).
          start: the slot's cache length to continue from (prompt + completion so far).
          generated: the slot's completion length after the tokens (its decode budget counts
            them).
          version: the params' weights version.
          segment: the slot's new segment number (``unpack_step``'s ``segment``).

        Raises:
          ValueError: no tokens, or the tokens do not fit the slot's cache (or its
            ``max_decode_length``) with room for one more token.
        """
        n = len(tokens)
        if n < 1:
            raise ValueError("extend needs at least one token")
        if start + n + 1 > self.cache_length or generated + 1 > self.max_decode_length:
            raise ValueError(
                f"{n} inserted tokens after {start} positions leave no room to decode (cache "
                f"{self.cache_length} positions, {self.max_decode_length} completion tokens)"
            )
        chunk = min(max(16, 1 << (n - 1).bit_length()), self.cache_length)
        tokens_t = np.zeros((chunk,), np.int32)
        tokens_t[:n] = tokens
        state, routing_tlk = self._extend_step(
            params,
            state,
            jnp.int32(slot),
            jnp.asarray(tokens_t),
            jnp.int32(n),
            jnp.int32(start),
            jnp.int32(generated),
            jnp.int32(version),
            jnp.int32(segment),
        )
        self._lengths_b[slot], self._generated_b[slot] = start + n, generated
        self.extend_calls += 1
        self.extend_tokens += n
        return state, routing_tlk[:n]

    def evict(self, state: DecodeState, slot: jax.Array | int, segment: int = -1) -> DecodeState:
        """Marks ``slot`` exhausted: it emits nothing valid until the next insert. A ``segment``
        >= 0 also becomes the slot's segment (a failed extension's, so its consumer sees the
        invalid steps)."""
        state = self._evict_step(state, jnp.int32(slot), jnp.int32(segment))
        self._generated_b[int(slot)] = self.max_decode_length
        return state

    def decode_window(self) -> int:
        """The positions the next step attends over: the smallest power of two (at least 16)
        above every active slot's cache length, capped at the cache length. The decode cost
        follows the live length with a few compiled variants (log2 of the cache length)."""
        active_b = self._generated_b < self.max_decode_length
        need = int(self._lengths_b[active_b].max(initial=0)) + 1
        return min(max(16, 1 << (need - 1).bit_length()), self.cache_length)

    def generate(
        self,
        params: Any,
        state: DecodeState,
        version: jax.Array | int,
        allowed_bv: np.ndarray | None = None,
    ) -> tuple[DecodeState, jax.Array]:
        """One sampling + decode step of every slot over ``decode_window()`` positions; returns
        (the new state, the step's [B, 7 + L·K] int32 output, see ``unpack_step``).

        ``allowed_bv`` ([B, V] bool, optional) restricts each slot's next token to its row (on
        top of ``sampleable_v``): constrained decoding, whose behavior log-prob is the masked
        distribution's, renormalized. Rows of unconstrained slots are all True (their tokens
        and log-probs are those of a step without it); None runs the unmasked program."""
        window = self.decode_window()
        if allowed_bv is None:
            state, data = self.generate_step(params, state, jnp.int32(version), window)
        else:
            allowed = jnp.asarray(allowed_bv, bool)
            state, data = self.generate_step(params, state, jnp.int32(version), window, allowed)
        active_b = self._generated_b < self.max_decode_length
        self._lengths_b += active_b
        self._generated_b += active_b
        return state, data

    def init_state(self, version: int = 0) -> DecodeState:
        """An empty KV cache (in ``param_dtype``, the serving dtype, or 8-bit with scales per
        ``kv_cache_dtype``) with every slot free (exhausted until an insert). The core tracks the
        slots of the last state it made."""
        c = self.config
        self._lengths_b[:] = 0
        self._generated_b[:] = self.max_decode_length
        shape = (c.num_layers, self.slots, self.cache_positions, c.num_kv_heads, c.head_dim)
        # Stored in the serving dtype (the params'), e.g. bfloat16 whatever the compute dtype.
        cache = empty_cache(shape, c.params_dtype, self.kv_cache_dtype)
        return DecodeState(
            cache=jax.jit(self._shard_cache)(cache),
            logits_bv=jnp.zeros((self.slots, c.vocab_size), jnp.float32),
            logits_version_b=jnp.full((self.slots,), version, jnp.int32),
            # Empty slots count as exhausted, so they emit nothing valid until an insert.
            generated_b=jnp.full((self.slots,), self.max_decode_length, jnp.int32),
            key=jax.random.key(self.seed),
            segment_b=jnp.zeros((self.slots,), jnp.int32),
        )

    def prefill_once(
        self, params: Any, tokens_p: np.ndarray, true_length: int, version: int
    ) -> Prefix:
        """Prefills ``tokens_p[:true_length]`` (padded to ``tokens_p``'s length), or reuses the
        previous call's result when the prompt and version are the same; ``prefill_calls`` counts
        the real prefills. Returns fresh copies of the device arrays, since a consumer may delete
        a prefix's arrays after inserting it (JetStream's orchestrator does)."""
        key = (np.asarray(tokens_p[:true_length], np.int32).tobytes(), int(version))
        with self._prefill_lock:
            if self._last_prefill is None or self._last_prefill[0] != key:
                prefix = self.prefill(
                    params, jnp.asarray(tokens_p), jnp.int32(true_length), jnp.int32(version)
                )
                self._last_prefill = (key, prefix)
                self.prefill_calls += 1
                self.prefill_tokens += int(true_length)
            prefix = self._last_prefill[1]
        return _copied(prefix)

    def prefill_prompt(self, params: Any, ids: Sequence[int], version: int = 0) -> Prefix:
        """``prefill_once`` of one prompt padded to ``max_prefill_length`` (one compiled shape)."""
        n = len(ids)
        if not 0 < n <= self.max_prefill_length:
            raise ValueError(
                f"the prompt has {n} tokens; it must have 1 to {self.max_prefill_length}"
            )
        tokens_p = np.zeros((self.max_prefill_length,), np.int32)
        tokens_p[:n] = ids
        return self.prefill_once(params, tokens_p, n, version)


@jax.jit
def _copied(tree: Any) -> Any:
    """A copy of every array of `tree`, in one program: one dispatch, where copying leaf by leaf
    dispatches one per leaf (a server copies a prefix for each of a group's samples)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _kernels_unplaceable() -> bool:
    """Whether this process has several TPU devices, where a program traced without a mesh cannot
    place a Pallas kernel (``sat_jax.model.tpu_kernels.kernels_placeable``)."""
    return jax.default_backend() == "tpu" and jax.device_count() > 1


def unpack_step(data: np.ndarray, num_moe_layers: int, k: int) -> dict[str, np.ndarray]:
    """Host-side view of one step's output [B, 7 + L·K] int32.

    Returns a dict of [B] arrays `token`, `valid`, `length` (the slot's completion length),
    `logp` (float32), `version`, `kept` (the sampler's kept-set size), `segment` (the slot's
    extensions so far), and `routing` [B, L, K] int32.
    """
    data = np.asarray(data)
    return {
        "token": data[:, TOKEN_COL],
        "valid": data[:, VALID_COL].astype(bool),
        "length": data[:, LENGTH_COL],
        "logp": np.ascontiguousarray(data[:, LOGP_COL]).view(np.float32),
        "version": data[:, VERSION_COL],
        "kept": data[:, KEPT_COL],
        "segment": data[:, SEGMENT_COL],
        "routing": data[:, ROUTING_COL:].reshape(-1, num_moe_layers, k),
    }
