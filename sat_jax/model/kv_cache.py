"""The KV cache of `Transformer.prefill`, `decode_step` and `extend` (docs/DESIGN.md §5), and
what those return.

Dimension letters: B rows (slots), T positions, S cache positions, V vocab, L MoE layers,
K experts per token, G key/value heads, H head_dim.
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class KVCache:
    """Keys and values of every layer for B independent rows (slots).

    Attributes:
      k_lbsgh: [num_layers, B, S, G, H] keys (normed and rotated).
      v_lbsgh: [num_layers, B, S, G, H] values.
      lengths_b: [B] int32 valid positions per row; the next token of row b goes to lengths_b[b].
    """

    k_lbsgh: jax.Array
    v_lbsgh: jax.Array
    lengths_b: jax.Array

    @property
    def max_len(self) -> int:
        return self.k_lbsgh.shape[2]


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
