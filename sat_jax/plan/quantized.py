"""The server's memory and decode roofline per ``server.weight_dtype`` × ``server.kv_cache_dtype``
(``--serve``'s table; docs/DESIGN.md §6.1).

From shapes: the served params per device as `programs.abstract_served_params` holds them (8-bit
values and float32 scales, in their shardings) and the cache as `programs.kv_cache_bytes` counts
it; the rest of a configuration's peak (the decode state's small arrays, two prefixes, the
largest program's temporaries, code) is the compiled configuration's, taken as is for every row.
A weight update holds the new served params beside the old ones (`MoEEngine.swap_params`). A push
the trainer quantized (8-bit servers, whole params, a local weights directory) arrives in the
served format, so its swap peak is the 8-bit params twice; a full-precision push (LoRA) is
quantized on the way in and also holds the full-precision params once
(`pushed_quantized`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh

from sat_jax import quant
from sat_jax.model import ModelConfig
from sat_jax.plan import programs

EXPERT_WEIGHTS = ("w_gate_edf", "w_up_edf", "w_down_efd")


@dataclasses.dataclass(frozen=True)
class ServedBytes:
    """Per-device bytes of one server configuration.

    Attributes:
      params: the served params (8-bit values and their scales for quantized weights).
      experts: the routed experts' share of ``params``.
      full: the params in the served float dtype (what a push restores before quantizing).
      cache: the KV cache (with its scales when 8-bit).
      pushed_quantized: pushes arrive in the served 8-bit format (quantized by the trainer).
    """

    params: int
    experts: int
    full: int
    cache: int
    pushed_quantized: bool = False

    @property
    def swap_peak(self) -> int:
        """Params held while a weight update installs: the old and new served ones, and the
        full-precision push when it is quantized on the way in."""
        quantized_on_install = self.params != self.full and not self.pushed_quantized
        return 2 * self.params + (self.full if quantized_on_install else 0)


def _device_bytes(x: jax.ShapeDtypeStruct) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def served_bytes(
    model_cfg: ModelConfig,
    mesh: Mesh,
    weight_dtype: str,
    kv_cache_dtype: str,
    *,
    slots: int,
    positions: int,
    cache_shards: int,
    pushed_quantized: bool = False,
) -> ServedBytes:
    """`ServedBytes` of ``model_cfg`` served on ``mesh`` in these formats; ``pushed_quantized``:
    8-bit rows' pushes arrive quantized (`pushes_quantized`)."""
    total = experts = 0
    leaves = jax.tree_util.tree_flatten_with_path(
        programs.abstract_served_params(model_cfg, mesh, weight_dtype)
    )[0]
    for path, x in leaves:
        n = _device_bytes(x)
        total += n
        if any(getattr(k, "key", None) in EXPERT_WEIGHTS for k in path):
            experts += n
    full = sum(_device_bytes(x) for x in jax.tree.leaves(programs.abstract_params(model_cfg, mesh)))
    cache = programs.kv_cache_bytes(model_cfg, slots, positions, kv_cache_dtype) // cache_shards
    pushed = pushed_quantized and weight_dtype != "bfloat16"
    return ServedBytes(total, experts, full, cache, pushed_quantized=pushed)


def pushes_quantized(lora_rank: int) -> bool:
    """Whether an 8-bit fleet's pushes arrive quantized: the trainer quantizes whole-params
    pushes (its weights directory is under the local ``train.run_dir``, flat or sharded, whose
    index records the format); LoRA pushes stay full precision (the server merges, then
    quantizes)."""
    return lora_rank == 0


def dtype_table(
    model_cfg: ModelConfig,
    mesh: Mesh,
    configured: tuple[str, str],
    configured_total: int,
    *,
    slots: int,
    positions: int,
    cache_shards: int,
    touched: float,
    hbm_bytes: int,
    hbm_gbps: float,
    pushed_quantized: bool = False,
) -> list[str]:
    """The table lines: per (weight_dtype, kv_cache_dtype), the per-device peak, whether it
    fits, what a decode step reads and the memory-bound tokens/s of one server, with the
    roofline against the first row (unquantized weights and cache)."""
    kw = dict(
        slots=slots,
        positions=positions,
        cache_shards=cache_shards,
        pushed_quantized=pushed_quantized,
    )
    here = served_bytes(model_cfg, mesh, *configured, **kw)
    rest = configured_total - here.swap_peak - here.cache
    rows, base = [], None
    lines = [
        f"by server.weight_dtype x server.kv_cache_dtype ({slots} slots; the rest of the peak, "
        f"{rest / 2**30:.3f} GiB, from the compiled {configured[0]} x {configured[1]}):",
        "  weights   cache     per device          params  KV cache  step reads   tokens/s  vs first",
    ]
    for w in quant.FORMATS:
        for kv in quant.FORMATS:
            b = served_bytes(model_cfg, mesh, w, kv, **kw)
            total = rest + b.swap_peak + b.cache
            reads = b.params - b.experts * (1.0 - touched) + b.cache
            tokens_s = slots / (reads / (hbm_gbps * 1e9))
            base = tokens_s if base is None else base
            fits = "fits" if total <= hbm_bytes else "does not fit"
            rows.append(
                f"  {w:<9} {kv:<9} {total / 2**30:>8.3f} GiB {fits:<12} "
                f"{b.params / 2**30:>7.3f} {b.cache / 2**30:>9.3f} {reads / 2**30:>9.3f} GiB "
                f"{tokens_s:>9,.0f} {tokens_s / base:>9.2f}x"
            )
    return lines + rows
