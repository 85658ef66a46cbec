"""RMSNorm, RoPE and GQA attention against float64 NumPy references written from the equations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.model.layers import Attention, DenseMLP, RMSNorm, apply_rope


# Test inputs come from NumPy and params from the RBG PRNG: both skip the slow XLA compile of
# threefry random ops for every new shape (it dominated this suite's run time).
def _rngs():
    return nnx.Rngs(jax.random.key(0, impl="rbg"))


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _np_rms_norm(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def _np_rope(x, pos, theta):
    """Rotate-half: for i < H/2 the pair (x_i, x_{i+H/2}) is rotated by pos * theta^(-2i/H)."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1]
    out = np.empty_like(x)
    for i in range(h // 2):
        ang = np.asarray(pos, np.float64)[:, :, None] * theta ** (-2.0 * i / h)
        a, b = x[..., i], x[..., i + h // 2]
        out[..., i] = a * np.cos(ang) - b * np.sin(ang)
        out[..., i + h // 2] = b * np.cos(ang) + a * np.sin(ang)
    return out


def _silu(x):
    return x / (1 + np.exp(-x))


def test_rms_norm_matches_reference():
    norm = RMSNorm(8, eps=1e-6, param_dtype=jnp.float32, rngs=_rngs())
    norm.scale[...] = jnp.linspace(0.5, 2.0, 8)
    x = _normal(0, (3, 5, 8)) * 3
    np.testing.assert_allclose(
        norm(x), _np_rms_norm(x, norm.scale[...], 1e-6), rtol=1e-5, atol=1e-6
    )


def test_rms_norm_keeps_dtype_and_computes_in_f32():
    norm = RMSNorm(8, eps=1e-6, param_dtype=jnp.float32, rngs=_rngs())
    x = _normal(0, (4, 8)).astype(jnp.bfloat16)
    y = norm(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        y.astype(np.float32), _np_rms_norm(x.astype(np.float32), np.ones(8), 1e-6), rtol=1e-2
    )


@pytest.mark.parametrize("theta", [10_000.0, 1_000_000.0])
def test_rope_matches_reference(theta):
    x = _normal(1, (2, 6, 3, 16))
    pos = jnp.array([[0, 1, 2, 3, 4, 5], [7, 9, 100, 3, 0, 2]])
    np.testing.assert_allclose(
        apply_rope(x, pos, theta=theta), _np_rope(x, pos, theta), rtol=1e-5, atol=1e-5
    )


def test_rope_scores_depend_only_on_relative_position():
    q = _normal(2, (1, 1, 1, 16))
    k = _normal(3, (1, 1, 1, 16))

    def score(pq, pk):
        rq = apply_rope(q, jnp.array([[pq]]), theta=1e4)
        rk = apply_rope(k, jnp.array([[pk]]), theta=1e4)
        return float(jnp.sum(rq * rk))

    assert score(5, 2) == pytest.approx(score(33, 30), rel=1e-4)


def _np_attention(attn: Attention, x, pos, allowed, eps):
    x = np.asarray(x, np.float64)
    p = lambda v: np.asarray(v[...], np.float64)
    q = np.einsum("btd,dnh->btnh", x, p(attn.w_q_dnh))
    k = np.einsum("btd,dgh->btgh", x, p(attn.w_k_dgh))
    v = np.einsum("btd,dgh->btgh", x, p(attn.w_v_dgh))
    q = _np_rope(_np_rms_norm(q, p(attn.q_norm.scale), eps), pos, attn.rope_theta)
    k = _np_rope(_np_rms_norm(k, p(attn.k_norm.scale), eps), pos, attn.rope_theta)
    n, g, h = q.shape[2], k.shape[2], q.shape[3]
    out = np.zeros(q.shape)
    for head in range(n):
        kv = head // (n // g)  # query head n uses KV head n // (N / G), as HF repeat_kv
        s = np.einsum("bth,bsh->bts", q[:, :, head], k[:, :, kv]) / np.sqrt(h)
        s = np.where(allowed, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[:, :, head] = np.einsum("bts,bsh->bth", w, v[:, :, kv])
    return np.einsum("btnh,nhd->btd", out, p(attn.w_o_nhd))


def test_gqa_attention_matches_reference():
    attn = Attention(
        d_model=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        eps=1e-6,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs=_rngs(),
    )
    attn.q_norm.scale[...] = jnp.linspace(0.5, 1.5, 8)
    x = _normal(4, (2, 5, 32))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    allowed = jnp.tril(jnp.ones((5, 5), bool))[None] & mask[:, None, :]

    @nnx.jit
    def run(attn, x, pos, allowed):
        qkv = attn.project(x, pos)
        return attn.attend(qkv.q_btnh, qkv.k_btgh, qkv.v_btgh, allowed)

    got = run(attn, x, pos, allowed)
    np.testing.assert_allclose(
        got, _np_attention(attn, x, pos, allowed, 1e-6), rtol=1e-5, atol=1e-5
    )


def test_dense_mlp_is_swiglu():
    mlp = DenseMLP(
        d_model=8, hidden_dim=12, dtype=jnp.float32, param_dtype=jnp.float32, rngs=_rngs()
    )
    x = _normal(5, (2, 3, 8))
    p = lambda v: np.asarray(v[...], np.float64)
    xn = np.asarray(x, np.float64)
    want = (_silu(xn @ p(mlp.w_gate_df)) * (xn @ p(mlp.w_up_df))) @ p(mlp.w_down_fd)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(mlp, x), want, rtol=1e-5, atol=1e-5)
