"""The KV cache of `Transformer.prefill`, `decode_step` and `extend` (docs/DESIGN.md §5), and
what those return.

Dimension letters: B rows (slots), T positions, S cache positions, V vocab, L MoE layers,
K experts per token, G key/value heads, H head_dim.
"""

from __future__ import annotations

import jax
from flax import struct

from sat_jax import quant


@struct.dataclass
class KVCache:
    """Keys and values of every layer for B independent rows (slots).

    Attributes:
      k_lbsgh: [num_layers, B, S, G, H] keys (normed and rotated).
      v_lbsgh: [num_layers, B, S, G, H] values.
      lengths_b: [B] int32 valid positions per row; the next token of row b goes to lengths_b[b].
      k_scale_lbsg, v_scale_lbsg: [num_layers, B, S, G] float32 scales of an 8-bit cache
        (keys and values in int8, or float8_e4m3fn bits as uint8, `sat_jax.quant.quantize_kv`: one scale per
        position and KV head); None for a cache in a float dtype.
    """

    k_lbsgh: jax.Array
    v_lbsgh: jax.Array
    lengths_b: jax.Array
    k_scale_lbsg: jax.Array | None = None
    v_scale_lbsg: jax.Array | None = None

    @property
    def max_len(self) -> int:
        return self.k_lbsgh.shape[2]

    @property
    def kv_format(self) -> str:
        """ "int8" or "fp8" for an 8-bit cache, "bfloat16" for one in a float dtype."""
        return quant.kv_format_of(self.k_lbsgh.dtype)

    def arrays(self) -> dict[str, jax.Array]:
        """The per-position arrays by field name (keys, values and, when 8-bit, their scales):
        each is [num_layers, B, S, ...], so a slot's or a position's update applies to all."""
        names = ("k_lbsgh", "v_lbsgh")
        if self.k_scale_lbsg is not None:
            names += ("k_scale_lbsg", "v_scale_lbsg")
        return {n: getattr(self, n) for n in names}

    def map_arrays(self, fn) -> KVCache:
        """This cache with ``fn(array)`` in place of every `arrays` entry (lengths kept)."""
        return self.replace(**{n: fn(x) for n, x in self.arrays().items()})


@struct.dataclass
class PrefillOutput:
    """Logits of the prompt, its routing (when asked for), and the filled cache."""

    logits_btv: jax.Array
    routing_btlk: jax.Array | None
    cache: KVCache


@struct.dataclass
class DecodeOutput:
    """Logits of the next token per row, this step's routing [B, L, K] (when asked), the cache."""

    logits_bv: jax.Array
    routing_blk: jax.Array | None
    cache: KVCache
