"""sat_jax.quant: per-channel int8 / fp8 round trips within each format's bound, against float64
references written from the formats' definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax import quant
from sat_jax.config.server import _QUANT_FORMATS

F32_EPS = 2.0**-23  # float32 rounding of x / scale and of q · scale, relative


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    # Channels of very different magnitudes, so a per-tensor scale would fail the per-channel bound.
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape[-1:]))
    return x.astype(np.float32)


def test_formats_match_the_config_keys():
    assert quant.FORMATS == _QUANT_FORMATS


@pytest.mark.parametrize("axes", [(0,), (0, 1)])
def test_int8_round_trip_within_half_a_step_per_channel(axes):
    x = _weights((64, 8, 16))
    q, scale = quant.quantize(jnp.asarray(x), "int8", axes)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32
    x64, s64 = x.astype(np.float64), np.asarray(scale, np.float64)
    np.testing.assert_allclose(s64, np.abs(x64).max(axis=axes, keepdims=True) / 127, rtol=1e-6)
    back = np.asarray(q, np.float64) * s64
    err = np.abs(back - x64)
    assert np.all(err <= s64 / 2 + np.abs(x64) * F32_EPS)
    assert np.abs(np.asarray(q)).max() == 127  # each channel's amax maps to ±127
    # The bound is tight: some element per channel is off by close to half a step.
    assert np.all(err.max(axis=axes) > 0.3 * s64.squeeze())


def test_fp8_round_trip_within_the_e4m3_mantissa_bound():
    x = _weights((128, 32))
    q, scale = quant.quantize(jnp.asarray(x), "fp8", (0,))
    assert q.dtype == jnp.float8_e4m3fn
    x64, s64 = x.astype(np.float64), np.asarray(scale, np.float64)
    y = x64 / s64
    back = np.asarray(q.astype(jnp.float32), np.float64) * s64
    # e4m3: 3 mantissa bits, so round to nearest is within 2^-4 relative for normal numbers
    # (|y| >= 2^-6) and within half the subnormal step 2^-9 below that.
    bound = s64 * np.maximum(np.abs(y) * 2.0**-4, 2.0**-10) + np.abs(x64) * 2 * F32_EPS
    assert np.all(np.abs(back - x64) <= bound)
    assert np.all(np.abs(y) <= 448 * (1 + 1e-6))
    assert np.isfinite(back).all()


def test_all_zero_channel_has_unit_scale_and_round_trips_exactly():
    x = np.zeros((4, 3), np.float32)
    x[:, 1] = [1.0, -2.0, 0.5, 0.0]
    for fmt in ("int8", "fp8"):
        q, scale = quant.quantize(jnp.asarray(x), fmt, (0,))
        assert float(scale[0, 0]) == 1.0
        back = np.asarray(quant.dequantize(q, scale, jnp.float32))
        np.testing.assert_array_equal(back[:, 0], 0.0)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_kv_scales_are_per_position_and_head(fmt):
    x = _weights((2, 5, 3, 16)).astype(np.float32)  # [B, T, G, H]
    q, scale = quant.quantize_kv(jnp.asarray(x), fmt)
    assert scale.shape == (2, 5, 3)
    qmax = 127 if fmt == "int8" else 448
    np.testing.assert_allclose(np.asarray(scale), np.abs(x).max(-1) / qmax, rtol=1e-6)
    back = np.asarray(quant.dequantize_kv(q, scale, jnp.float32))
    np.testing.assert_array_equal(back, np.asarray(quant.fake_quantize_kv(jnp.asarray(x), fmt)))


def test_quantize_params_touches_only_the_matmul_weights():
    params = {
        "embedding_vd": jnp.ones((10, 4)),
        "lm_head_dv": jnp.asarray(_weights((4, 10))),
        "layers": {
            0: {
                "attn": {
                    "w_o_nhd": jnp.asarray(_weights((2, 3, 4))),
                    "q_norm": {"scale": jnp.ones(3)},
                },
                "mlp": {
                    "w_router_de": jnp.ones((4, 8)),
                    "w_down_efd": jnp.asarray(_weights((8, 6, 4))),
                },
            }
        },
    }
    q = quant.quantize_params(params, "int8")
    assert isinstance(q["lm_head_dv"], quant.QTensor)
    assert q["lm_head_dv"].scale.shape == (1, 10)
    assert q["layers"][0]["attn"]["w_o_nhd"].scale.shape == (1, 1, 4)
    assert q["layers"][0]["mlp"]["w_down_efd"].scale.shape == (8, 1, 4)  # per expert and channel
    for kept in (q["embedding_vd"], q["layers"][0]["mlp"]["w_router_de"]):
        assert not isinstance(kept, quant.QTensor)
    back = quant.dequantize_params(jax.jit(lambda t: t)(q))
    assert jax.tree.structure(back) == jax.tree.structure(params)
    w = np.asarray(params["lm_head_dv"], np.float64)
    err = np.abs(np.asarray(back["lm_head_dv"], np.float64) - w)
    assert np.all(err <= np.asarray(q["lm_head_dv"].scale) / 2 + np.abs(w) * F32_EPS)
    assert quant.quantize_params(params, "bfloat16") is params


def test_bad_format_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="server.kv_cache_dtype must be one of"):
        quant.check_format("int4", "server.kv_cache_dtype")
