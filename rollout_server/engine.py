"""A JetStream `Engine` over the sat_jax Flax MoE policy, with hot-swappable weights.

A thin adapter: the jitted KV-cache work (prefill, insert into a slot, one sampling + decode step
for every slot, with behavior log-probs, versions and routing ids in extra int32 columns of
`ResultTokens.data`) is `sat_jax.decoding.DecodeCore`, the same code evaluation runs. This class
adds what JetStream needs: its Engine API, the `(version, params)` in use and their swap, the
tokenizer, and the prompt (ids and routing) of each slot kept on the host.

JetStream 0.2.2's prefill emits no token: the prefix keeps the last prompt position's logits and
`generate` samples from them, as MaxText's engine of that era did. So a token's version is the
version of the params that produced its logits; after a swap, the first token of each slot still
comes from the old params' logits and every later one from the new params. KV entries computed
before a swap are kept, not recomputed (the usual in-flight update).

Sampling is restricted to `sat_jax.tasks.sampleable_mask` (every tokenizer id, embedding rows past
the tokenizer never; the character tokenizer also excludes pad and bos); the behavior log-prob is
under that restricted, temperature/top-k/top-p-adjusted distribution. Prompts are the tokenizer's
ids as they are: JetStream's BOS is never prepended (`RolloutDriver`, docs/DESIGN.md §11).

Multi-turn episodes continue in their slot: the driver's detokenize thread asks for an extension
(`schedule_extend`: the observation tokens, where the turn ended) and the generate thread applies
it at the start of its next `generate`, before that step samples (`DecodeCore.extend`: only the new
tokens are computed). The slot's segment number, in every step's output, tells the driver which
steps follow the extension; the inserted tokens' routing waits on the host side of the engine
(`extension_routing`) until the driver takes it with the first of those steps, so observation
tokens carry recorded routing like the prompt and the generated tokens.

Constrained decoding (`response_format`, docs/DESIGN.md §6.6): a request's canonical format
reaches `prefill` from the driver (thread-local, `SlotFormats.next_prefill`) and its slot at
`insert`, or a continued turn's with its extension; `generate` then advances each constrained
slot's automaton by the previous step's token and samples under the [B, V] mask rows
(`DecodeCore.generate(allowed_bv=...)`). With no slot constrained nothing is read back and the
unmasked program runs.

The engine owns `(version, params)` and passes params into the core's jitted functions as
arguments, so `swap_params` changes weights between two steps without recompiling; weights of
another float dtype are cast to the engine's serving dtype (e.g. float32 trainer weights served in
bfloat16). The `params` JetStream passes back into `prefill`/`generate` (captured once by its
threads) are ignored.

With `weight_dtype` "int8" or "fp8" the engine quantizes what it installs (`sat_jax.quant`: the
experts, attention projections, dense MLPs and LM head per output channel; router, norms and
embedding as they are) and holds only the 8-bit weights and their scales; every program
dequantizes them on use. The trainer keeps full-precision masters; a push carries either its
serving-dtype cast, which the engine quantizes on install, or that cast already quantized by the
same function (`quant.QTensor` leaves: values and scales, about half the bytes), which a server of
that `weight_dtype` installs as it is, bit-identical to quantizing on install. A pre-quantized
push of another format (or to an unquantized server) is dequantized and then installed as a
full-precision one (logged). A LoRA push is merged into its full-precision base first, then
quantized. With `kv_cache_dtype` "int8"
or "fp8" the decode cache is 8-bit (`DecodeCore`). Behavior log-probs and routing are the
quantized model's own: what sampled the token.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollout_server import jetstream_compat  # noqa: F401  (must precede jetstream imports)

# isort: split
from jetstream.engine import engine_api, tokenizer_pb2

from rollout_server.jetstream_tokenizer import JetStreamTokenizer
from rollout_server.json_mask import SlotFormats
from rollout_server.loop_stats import DecodeClock
from sat_jax import quant
from sat_jax.decoding import (
    LENGTH_COL,
    TOKEN_COL,
    VALID_COL,
    DecodeCore,
    DecodeState,
    Prefix,
    SamplingConfig,
    unpack_step,
)
from sat_jax.model import Transformer
from sat_jax.tasks import Tokenizer, sampleable_mask

log = logging.getLogger(__name__)


class FailedPrefix:
    """What `prefill` returns instead of raising; `insert` leaves the slot empty for it."""

    def __init__(self, error: str):
        self.error = error


class MoEEngine(engine_api.Engine):
    """JetStream engine for `sat_jax.model.Transformer` (interleaved mode, one mesh).

    Args:
      model: the policy; its params become version `version`.
      tokenizer: prompts' and completions' tokenizer (its ids must fit the model's vocab).
      slots: concurrent decodes.
      max_prefill_length: longest prompt; a power of two in [16, 32768].
      max_decode_length: most tokens generated per request.
      sampling: temperature / top-k / top-p.
      seed: sampling PRNG seed.
      version: version number of the initial params.
      mesh: the mesh the params are sharded over (`server.mesh`); the KV cache is sharded on it
        too (`DecodeCore`). Default: one device.
      weight_dtype: "bfloat16" (serve the params as they are) or "int8" / "fp8" (`server.weight_dtype`).
      kv_cache_dtype: "bfloat16" or "int8" / "fp8" (`server.kv_cache_dtype`).

    Raises:
      ValueError: a format that is not one of `quant.FORMATS`, or one this backend cannot run
        (naming the key).
    """

    def __init__(
        self,
        model: Transformer,
        *,
        tokenizer: Tokenizer,
        slots: int,
        max_prefill_length: int,
        max_decode_length: int,
        sampling: SamplingConfig,
        seed: int = 0,
        version: int = 0,
        mesh: jax.sharding.Mesh | None = None,
        weight_dtype: str = "bfloat16",
        kv_cache_dtype: str = "bfloat16",
    ):
        check_backend_formats(weight_dtype, kv_cache_dtype)
        self.weight_dtype = weight_dtype
        n = max_prefill_length
        if n < 16 or n > 32768 or n & (n - 1):
            raise ValueError(f"max_prefill_length must be a power of two in [16, 32768], got {n}")
        self.config = model.config
        self.tokenizer = tokenizer
        self.sampling = sampling
        self._slot_prompts: list[tuple[np.ndarray, np.ndarray] | None] = [None] * slots
        graphdef, state = nnx.split(model)
        # The trainer renormalizes over the same set (raises if the tokenizer outgrows the model).
        self.core = DecodeCore(
            graphdef,
            model.config,
            slots=slots,
            max_prefill_length=max_prefill_length,
            max_decode_length=max_decode_length,
            sampling=sampling,
            sampleable_v=sampleable_mask(tokenizer, model.config.vocab_size),
            seed=seed,
            mesh=mesh,
            kv_cache_dtype=kv_cache_dtype,
        )
        # Committed placement now, so swapped-in params (device_put onto these shardings) hit
        # the same compiled executables.
        params = jax.tree_util.tree_map(
            lambda x: jax.device_put(x, x.sharding), nnx.to_pure_dict(state)
        )
        # What a push must look like: the full-precision tree (shapes, dtypes, shardings).
        self._like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
        )
        self._quantize = jax.jit(functools.partial(quant.quantize_params, fmt=weight_dtype))
        self._current = (int(version), self._installed(params))
        # What a pre-quantized push of `weight_dtype` must look like: the served tree's layout.
        self._served_like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self._current[1],
        )
        self._swap_lock = threading.Lock()
        # (slot, tokens, start, generated, segment, response format) for the generate thread.
        self._extensions: list[tuple[int, np.ndarray, int, int, int, str | None]] = []
        # slot -> (segment, the inserted tokens' routing [n, L, K] on device), until the driver
        # takes it (`extension_routing`).
        self._extension_routing: dict[int, tuple[int, jax.Array]] = {}
        self._extensions_lock = threading.Lock()
        self.formats = SlotFormats(tokenizer, model.config.vocab_size, slots)
        self._mesh = mesh or jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        # Generate steps' busy seconds: noted here at dispatch, by the driver when on the host.
        self.decode_clock = DecodeClock()

    @property
    def prefill_calls(self) -> int:
        """Prefills run so far; a group's G requests of one prompt share one (`DecodeCore`)."""
        return self.core.prefill_calls

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the prefills computed."""
        return self.core.prefill_tokens

    @property
    def extend_tokens(self) -> int:
        """Observation tokens the multi-turn extensions computed."""
        return self.core.extend_tokens

    @property
    def max_decode_length(self) -> int:
        """Most completion tokens per request (an episode's generated and inserted tokens)."""
        return self.core.max_decode_length

    @property
    def sampleable_ids(self) -> np.ndarray:
        """[V] bool: the token ids sampling may produce."""
        return self.core.sampleable_v

    # Weights.

    @property
    def version(self) -> int:
        """The weights version now in use."""
        return self._current[0]

    def current_params(self) -> tuple[int, Any]:
        """(version, params) now in use, in the full-precision layout a push restores into.
        With 8-bit weights (`weight_dtype`) the params are that layout's abstract arrays
        (`jax.ShapeDtypeStruct`s with their shardings; the engine holds only the quantized
        ones, `served_params`)."""
        version, params = self._current
        return version, (self._like if quant.is_quantized(self.weight_dtype) else params)

    def served_params(self) -> tuple[int, Any]:
        """(version, the params the programs run): with 8-bit weights, `quant.QTensor` leaves."""
        return self._current

    def _installed(self, params: Any) -> Any:
        """``params`` (placed like the current ones) as served: quantized per `weight_dtype`.

        Raises:
          ValueError: 8-bit weights and a non-finite value (no scale can hold it).
        """
        if not quant.is_quantized(self.weight_dtype):
            return params
        if not bool(quant.all_finite(params)):
            raise ValueError(
                f"the params hold inf or NaN: server.weight_dtype {self.weight_dtype} cannot "
                "quantize them"
            )
        return self._quantize(params)

    def swap_params(self, version: int, params: Any) -> None:
        """Installs new params for every later step; they land on the old params' shardings.

        The old params stay alive until the step in flight finishes, so for a moment both
        versions occupy memory.

        With 8-bit weights (`weight_dtype`) full-precision params are quantized here, and
        pre-quantized ones of the same format (`quant.QTensor` leaves, `quant.quantize_params`)
        are installed as they are; pre-quantized params of another format are dequantized first.
        Params that cannot be served (inf or NaN where 8-bit weights are made or installed) are
        refused and the served weights stay as they were.

        Raises:
          ValueError: the tree structure or a leaf's shape differs from the current params (or,
            pre-quantized, from their quantized layout), a leaf's dtype differs other than float
            for float, the version is outside [0, 2**31), the params mix formats, or 8-bit
            weights cannot be made of (or installed from) the params.
        """
        if not 0 <= version < 2**31:
            raise ValueError(f"version must be in [0, 2**31), got {version}")
        fmt = quant.tree_format(params)
        with self._swap_lock:
            if quant.is_quantized(fmt) and fmt == self.weight_dtype:
                placed = _placed_tree(params, self._served_like)
                if not bool(quant.all_finite(placed)):
                    raise ValueError(
                        f"the pushed {fmt} weights hold inf or NaN: server.weight_dtype {fmt} "
                        "cannot install them"
                    )
            else:
                if quant.is_quantized(fmt):
                    _check_backend_format("the push's weight_dtype", fmt)
                    log.warning(
                        "a %s push to a server.weight_dtype %s server: dequantized, then "
                        "installed as full precision",
                        fmt,
                        self.weight_dtype,
                    )
                    params = _dequantized(params)
                placed = self._installed(_placed_tree(params, self._like))
            jax.block_until_ready(placed)
            self._current = (int(version), placed)

    # The JetStream Engine API (0.2.2 signatures; extra kwargs of later versions are ignored).

    def load_params(self, *args, **kwargs) -> Any:
        """The current params (JetStream captures them once; the engine ignores them later)."""
        return self._current[1]

    def prefill(
        self,
        *,
        params: Any = None,
        existing_prefix: Any = None,
        padded_tokens: jax.Array | np.ndarray,
        true_length: int,
        **kwargs,
    ) -> Prefix | FailedPrefix:
        """Never raises (JetStream would kill the process): a failure returns a `FailedPrefix`,
        which `insert` turns into a slot that emits nothing valid."""
        try:
            if existing_prefix is not None:
                raise NotImplementedError("prefix continuation is not supported")
            tokens_p = np.asarray(padded_tokens, np.int32)
            if not 0 < true_length <= tokens_p.shape[0] <= self.max_prefill_length:
                raise ValueError(f"bad prefill: {tokens_p.shape} tokens, true_length {true_length}")
            version, current = self._current
            fmt = self.formats.take_prefill_format()
            prefix = self.core.prefill_once(current, tokens_p, true_length, version)
            return prefix.replace(prompt_ids=tokens_p[:true_length].copy(), response_format=fmt)
        except Exception as e:
            log.exception("prefill failed")
            return FailedPrefix(repr(e))

    def insert(
        self, prefix: Prefix | FailedPrefix, decode_state: DecodeState, slot: int, **kwargs
    ) -> DecodeState:
        """Copies the prompt and its routing to host (the orchestrator deletes the prefix's
        arrays right after), then writes the prefix into `slot`. A failed prefix or insert leaves
        the slot exhausted, so the request ends with no valid token."""
        try:
            if isinstance(prefix, FailedPrefix):
                raise RuntimeError(f"prefill had failed: {prefix.error}")
            n = int(prefix.true_length)
            self._slot_prompts[slot] = (
                np.asarray(prefix.prompt_ids),
                np.asarray(prefix.routing_plk)[:n],
            )
            self.formats.set(slot, prefix.response_format, segment=0)
            bare = prefix.replace(prompt_ids=np.zeros((0,), np.int32), response_format=None)
            return self.core.insert(bare, decode_state, jnp.int32(slot))
        except Exception:
            log.exception("insert into slot %d failed; the slot stays empty", slot)
            self._slot_prompts[slot] = None
            self.formats.set(slot, None, segment=0)
            return self.core.evict(decode_state, jnp.int32(slot))

    def slot_prompt(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids [P], prompt routing [P, L, K]) of the request last inserted into `slot`."""
        entry = self._slot_prompts[slot]
        if entry is None:
            raise KeyError(f"slot {slot} holds no prompt (nothing or a failed insert)")
        return entry

    def schedule_extend(
        self,
        slot: int,
        tokens: np.ndarray,
        *,
        start: int,
        generated: int,
        segment: int,
        response_format: str | None = None,
    ) -> None:
        """Asks the generate thread to continue `slot` after `tokens` (`DecodeCore.extend`'s
        arguments) before its next step, the next turn constrained to `response_format`
        (`SlotFormats`; None = free). Thread-safe; a failure is logged and leaves the slot
        exhausted, so its request ends with no valid token."""
        tokens = np.asarray(tokens, np.int32)
        with self._extensions_lock:
            self._extensions.append((slot, tokens, start, generated, segment, response_format))

    def extension_routing(self, slot: int, segment: int) -> np.ndarray:
        """[n, L, K] routing ids of the tokens `slot`'s extension to `segment` inserted, as its
        chunked forward routed them (taken: each extension's routing is returned once). The
        driver reads it when the first step of that segment arrives, so the extension has run.
        Thread-safe.

        Raises:
          KeyError: no routing of that extension is waiting.
        """
        with self._extensions_lock:
            entry = self._extension_routing.pop(slot, None)
        if entry is None or entry[0] != segment:
            raise KeyError(f"no routing of slot {slot}'s extension to segment {segment}")
        return np.asarray(entry[1])

    def _apply_extensions(self, state: DecodeState, version: int, params: Any) -> DecodeState:
        with self._extensions_lock:
            pending, self._extensions = self._extensions, []
        for slot, tokens, start, generated, segment, fmt in pending:
            self.formats.set(slot, fmt, segment=segment)
            try:
                state, routing = self.core.extend(
                    params,
                    state,
                    slot,
                    tokens,
                    start=start,
                    generated=generated,
                    version=version,
                    segment=segment,
                )
                with self._extensions_lock:
                    self._extension_routing[slot] = (segment, routing)
            except Exception:
                log.exception("extending slot %d failed; the slot stays empty", slot)
                state = self.core.evict(state, jnp.int32(slot), segment)
        return state

    def generate(
        self, params: Any, decode_state: DecodeState, **kwargs
    ) -> tuple[DecodeState, engine_api.ResultTokens]:
        """One step for every slot under the current (version, params), after the extensions
        scheduled since the last step; `params` is ignored."""
        version, current = self._current
        self.formats.advance()
        if self._extensions:
            decode_state = self._apply_extensions(decode_state, version, current)
        allowed_bv = self.formats.allowed()
        state, data = self.core.generate(current, decode_state, jnp.int32(version), allowed_bv)
        self.formats.sampled(data)
        self.decode_clock.dispatched()
        return state, engine_api.ResultTokens(
            data=data,
            tokens_idx=(TOKEN_COL, TOKEN_COL + 1),
            valid_idx=(VALID_COL, VALID_COL + 1),
            length_idx=(LENGTH_COL, LENGTH_COL + 1),
            samples_per_slot=1,
        )

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """An empty KV cache with every slot free (exhausted until an insert)."""
        return self.core.init_state(self.version)

    def get_prefix_destination_sharding(self) -> Any:
        return None

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=type(self.tokenizer).__name__)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
        return JetStreamTokenizer(self.tokenizer)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.core.slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.core.max_prefill_length

    def check_prompt_length(self, n_tokens: int) -> None:
        """Checks that a prompt of `n_tokens` (as the tokenizer encodes it) fits one prefill.

        Raises:
          ValueError: the prompt is empty, or longer than `max_prefill_length`.
        """
        if n_tokens == 0:
            raise ValueError("the prompt is empty")
        if n_tokens > self.core.max_prefill_length:
            raise ValueError(
                f"the prompt has {n_tokens} tokens; max_prefill_length is "
                f"{self.core.max_prefill_length}"
            )

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None


def check_backend_formats(weight_dtype: str, kv_cache_dtype: str) -> None:
    """Raises ValueError (one line naming the key) unless both are `quant.FORMATS` this
    process's default backend can quantize and dequantize."""
    for key, fmt in (
        ("server.weight_dtype", weight_dtype),
        ("server.kv_cache_dtype", kv_cache_dtype),
    ):
        _check_backend_format(key, fmt)


def _check_backend_format(key: str, fmt: str) -> None:
    """Raises ValueError (one line naming ``key``) unless ``fmt`` is one of `quant.FORMATS` this
    process's default backend can quantize and dequantize."""
    quant.check_format(fmt, key)
    if not quant.is_quantized(fmt):
        return
    try:
        x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)
        jax.block_until_ready(
            jax.jit(functools.partial(quant.fake_quantize, fmt=fmt, axes=(1,)))(x)
        )
    except Exception as e:  # the backend's compiler refuses the 8-bit dtype
        raise ValueError(
            f"{key} {fmt}: the {jax.default_backend()} backend cannot run it ({e})"
        ) from e


_dequantized = jax.jit(quant.dequantize_params)


def _placed_tree(params: Any, like: Any) -> Any:
    """``params`` on ``like``'s shardings and dtypes (`_placed_like`), each `quant.QTensor`
    taking ``like``'s dequantized dtype.

    Raises:
      ValueError: another tree structure, a leaf of another shape, or a dtype that is not
        ``like``'s other than float for float (8-bit values and float32 scales: exactly theirs).
    """
    is_q = lambda x: isinstance(x, quant.QTensor)
    try:  # a QTensor's dtype is static (in the tree's structure): take the served one
        params = jax.tree.map(
            lambda n, o: n.replace(dtype=o.dtype) if is_q(n) and is_q(o) else n,
            params,
            like,
            is_leaf=is_q,
        )
    except (ValueError, TypeError) as e:
        raise ValueError("new params have a different tree structure") from e
    old_leaves, old_def = jax.tree_util.tree_flatten(like)
    new_leaves, new_def = jax.tree_util.tree_flatten(params)
    if old_def != new_def:
        raise ValueError("new params have a different tree structure")
    for o, n in zip(old_leaves, new_leaves, strict=True):
        if o.shape != n.shape or not _castable(np.dtype(n.dtype), o.dtype):
            raise ValueError(f"param leaf {n.shape}/{n.dtype} does not match {o.shape}/{o.dtype}")
    placed = [_placed_like(n, o) for o, n in zip(old_leaves, new_leaves, strict=True)]
    return jax.tree_util.tree_unflatten(old_def, placed)


def _placed_like(new: Any, old: jax.Array) -> jax.Array:
    """`new` on `old`'s sharding and dtype: as it is when it is already there (what the weights
    loader restores), else copied and cast."""
    if isinstance(new, jax.Array) and new.sharding == old.sharding and new.dtype == old.dtype:
        return new
    return jax.device_put(new, old.sharding).astype(old.dtype)


def _castable(new: np.dtype, old: np.dtype) -> bool:
    """Whether a swapped-in leaf of dtype `new` may replace one of `old` (equal, or both float
    and neither an 8-bit storage dtype)."""
    if new == old:
        return True
    floats = jnp.issubdtype(new, jnp.floating) and jnp.issubdtype(old, jnp.floating)
    return floats and quant.format_of(new) == quant.format_of(old) == "bfloat16"


__all__ = ["FailedPrefix", "MoEEngine", "check_backend_formats", "unpack_step"]
