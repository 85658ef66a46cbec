"""sat_jax.plan.quantized: per-device bytes of 8-bit served weights and caches, from shapes, and
the --serve table of every server.weight_dtype x server.kv_cache_dtype."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import quant, sharding
from sat_jax.model import ModelConfig
from sat_jax.plan import programs, quantized

CFG = ModelConfig.preset("tiny").replace(param_dtype=jnp.bfloat16)
MESH = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
KW = dict(slots=4, positions=32, cache_shards=1)


def test_served_bytes_count_8bit_values_and_float32_scales():
    full = programs.abstract_params(CFG, MESH)
    flat = jax.tree_util.tree_flatten_with_path(full)[0]
    want = 0
    for path, x in flat:
        axes = quant.CONTRACTION_AXES.get(path[-1].key)
        n = math.prod(x.shape)
        if axes is None:
            want += n * 2
        else:
            scale = n // math.prod(x.shape[a] for a in axes)
            want += n + 4 * scale
    got = quantized.served_bytes(CFG, MESH, "int8", "fp8", **KW)
    assert got.params == want
    assert got.full == sum(math.prod(x.shape) * 2 for _, x in flat)
    assert 0 < got.experts < got.params
    assert got.swap_peak == 2 * got.params + got.full
    plain = quantized.served_bytes(CFG, MESH, "bfloat16", "bfloat16", **KW)
    assert plain.params == plain.full and plain.swap_peak == 2 * plain.full
    # A push the trainer quantized arrives in the served format: no full-precision copy at the
    # swap; a full-precision push (LoRA) still holds one; unquantized rows are unchanged.
    pushed = quantized.served_bytes(CFG, MESH, "int8", "fp8", pushed_quantized=True, **KW)
    assert pushed.swap_peak == 2 * got.params
    plain_pushed = quantized.served_bytes(CFG, MESH, "bfloat16", "fp8", pushed_quantized=True, **KW)
    assert plain_pushed.swap_peak == 2 * plain.full
    assert quantized.pushes_quantized(0) and not quantized.pushes_quantized(8)
    # Cache: 1 byte per element and a 4-byte scale per position and head, against 2 bytes.
    per_head = CFG.head_dim + 4
    assert got.cache == 4 * 32 * 2 * CFG.num_layers * CFG.num_kv_heads * per_head
    assert plain.cache == 4 * 32 * 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 2


def test_the_table_has_every_combination_and_reads_fewer_bytes_when_quantized():
    lines = quantized.dtype_table(
        CFG,
        MESH,
        ("bfloat16", "bfloat16"),
        10 * 2**30,
        touched=1.0,
        hbm_bytes=95 * 2**30,
        hbm_gbps=2765.0,
        **KW,
    )
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [(w, kv) for w in quant.FORMATS for kv in quant.FORMATS]
    speedup = {(r[0], r[1]): float(r[-1].rstrip("x")) for r in rows}
    assert speedup[("bfloat16", "bfloat16")] == 1.0
    assert speedup[("int8", "fp8")] > speedup[("int8", "bfloat16")] > 1.0
    assert speedup[("int8", "fp8")] == speedup[("fp8", "int8")]
    assert np.isclose(speedup[("bfloat16", "int8")], speedup[("bfloat16", "fp8")])
