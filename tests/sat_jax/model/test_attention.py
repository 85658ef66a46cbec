"""Memory-linear training forward: blockwise attention, chunked log-probs, remat, scanned layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.model import ModelConfig, Transformer, token_logprobs
from sat_jax.model.attention import blockwise_attention, causal_attention, dense_attention

RTOL, ATOL = 1e-5, 1e-5
# vocab_size differs from every other width so a [B, T, V] buffer is recognisable in the HLO.
TINY = ModelConfig.preset(
    "tiny", router_aux_loss_coef=0.01, attention_block=5, logits_chunk=4, vocab_size=97
)


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _valid(b, t, seed=0):
    lengths = np.random.default_rng(seed).integers(1, t + 1, (b, 1))
    lengths[0] = t
    return jnp.asarray(np.arange(t)[None] < lengths)


def _dense_causal(q, k, v, valid):
    t = q.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
    return dense_attention(q, k, v, allowed, jnp.float32)


@pytest.mark.parametrize(("t", "block"), [(12, 5), (16, 4), (7, 16)])
def test_blockwise_equals_dense_attention_and_gradient(t, block):
    b, g, r, h = 3, 2, 2, 8
    q, k, v = _normal(0, (b, t, g, r, h)), _normal(1, (b, t, g, h)), _normal(2, (b, t, g, h))
    valid = _valid(b, t)
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, valid, block=block)
    dense = lambda q, k, v: _dense_causal(q, k, v, valid)
    np.testing.assert_allclose(blockwise(q, k, v), dense(q, k, v), rtol=RTOL, atol=ATOL)
    weights = _normal(3, (b, t, g, r, h)) * valid[:, :, None, None, None]
    loss = lambda f: lambda *a: jnp.sum(f(*a) * weights)
    got = jax.grad(loss(blockwise), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    for name, g_, w in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(g_, w, rtol=RTOL, atol=ATOL, err_msg=name)


def test_fused_path_equals_dense_on_this_backend():
    b, t, g, r, h = 2, 9, 2, 2, 8
    q, k, v = _normal(4, (b, t, g, r, h)), _normal(5, (b, t, g, h)), _normal(6, (b, t, g, h))
    valid = _valid(b, t, seed=1)
    got = causal_attention(q, k, v, valid, path="fused", block=4, dtype=jnp.float32)
    np.testing.assert_allclose(got, _dense_causal(q, k, v, valid), rtol=RTOL, atol=ATOL)


def _params_and_graph(cfg):
    model = Transformer(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    return nnx.split(model)


def _loss(cfg, graphdef):
    def f(params, tokens, mask):
        model = nnx.merge(graphdef, params)
        out = model.forward(tokens, mask_bt=mask)
        logp = model.target_logprobs(out.hidden_btd[:, :-1], tokens[:, 1:])
        return jnp.sum(logp * mask[:, 1:]) + out.aux_loss, out.logits_btv

    return jax.jit(jax.value_and_grad(f, has_aux=True))


@pytest.mark.parametrize(
    "overrides", [dict(attention="blockwise"), dict(attention="blockwise", remat="layer")]
)
def test_forward_paths_equal_the_dense_reference(overrides):
    ref_cfg = TINY.replace(attention="dense")
    graphdef, params = _params_and_graph(ref_cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (3, 11)))
    mask = _valid(3, 11, seed=2).astype(jnp.float32)
    (want_loss, want_logits), want_grads = _loss(ref_cfg, graphdef)(params, tokens, mask)
    cfg = TINY.replace(**overrides)
    graphdef2, _ = _params_and_graph(cfg)
    (loss, logits), grads = _loss(cfg, graphdef2)(params, tokens, mask)
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(logits[valid], want_logits[valid], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=ATOL, err_msg=jax.tree_util.keystr(path))


def test_target_logprobs_equal_full_logits_and_never_build_them():
    graphdef, params = _params_and_graph(TINY)
    b, t = 2, 11
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, TINY.vocab_size, (b, t)))
    vocab_mask = np.arange(TINY.vocab_size) % 3 != 0

    def chunked(params, tokens):
        model = nnx.merge(graphdef, params)
        out = model.forward(tokens)
        return model.target_logprobs(out.hidden_btd, tokens, temperature=0.7, vocab_mask=vocab_mask)

    def full(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)
        return token_logprobs(logits, tokens, temperature=0.7, vocab_mask=vocab_mask)

    got, want = jax.jit(chunked)(params, tokens), jax.jit(full)(params, tokens)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    hlo = jax.jit(jax.grad(lambda p, x: jnp.sum(chunked(p, x)))).lower(params, tokens)
    text = hlo.compile().as_text()
    assert f"f32[{b},{t},{TINY.vocab_size}]" not in text
    assert f"f32[{b},{TINY.logits_chunk},{TINY.vocab_size}]" in text


def test_layers_compile_once_whatever_the_depth():
    # One dense layer then MoE layers: two scanned runs whatever the depth, so the program holds
    # the same matmuls for 2 layers as for 6 (an unrolled loop would hold 3x more).
    dots = {}
    for layers in (2, 6):
        cfg = TINY.replace(num_layers=layers, mlp_only_layers=(0,))
        graphdef, params = _params_and_graph(cfg)
        tokens = jnp.zeros((1, 8), jnp.int32)
        f = lambda p, x, graphdef=graphdef: nnx.merge(graphdef, p).forward(x).aux_loss
        text = jax.jit(jax.grad(f)).lower(params, tokens).as_text()
        dots[layers] = text.count("stablehlo.dot_general")
    assert dots[6] == dots[2] > 0, dots


@pytest.mark.parametrize(("field", "value"), [("attention", "flash"), ("remat", "full")])
def test_config_names_bad_paths(field, value):
    with pytest.raises(ValueError, match=field):
        TINY.replace(**{field: value})


@pytest.mark.parametrize("path", ["dense", "blockwise", "fused", "splash"])
def test_packed_segments_equal_each_sequence_alone(path):
    """Packed rows (segment ids, 0 on padding): every path's output and gradient at a segment's
    positions equal that sequence's attention run alone (splash in Pallas interpret mode)."""
    g, r, h, t = 2, 2, 8, 16
    # Two packed rows: segments of 5, 7 and 3 tokens (one padding slot), and of 9 and 4 (3).
    layout = [[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0], [4] * 9 + [5] * 4 + [0] * 3]
    seg = jnp.asarray(layout, jnp.int32)
    q, k, v = _normal(7, (2, t, g, r, h)), _normal(8, (2, t, g, h)), _normal(9, (2, t, g, h))
    weights = _normal(10, q.shape) * (seg > 0)[:, :, None, None, None]

    def packed(q, k, v):
        valid = seg > 0
        return causal_attention(
            q, k, v, valid, path=path, block=4, dtype=jnp.float32, segment_ids_bt=seg
        )

    def alone(q, k, v):
        out = jnp.zeros_like(q)
        for row, ids in enumerate(layout):
            for s in sorted(set(ids) - {0}):
                cols = np.flatnonzero(np.asarray(ids) == s)
                sl = (row, slice(cols[0], cols[-1] + 1))
                one = _dense_causal(
                    q[sl][None], k[sl][None], v[sl][None], jnp.ones((1, len(cols)), bool)
                )
                out = out.at[sl].set(one[0])
        return out

    loss = lambda f: lambda *a: jnp.sum(f(*a) * weights)
    mask = np.asarray(seg > 0)
    np.testing.assert_allclose(
        np.asarray(packed(q, k, v))[mask], np.asarray(alone(q, k, v))[mask], rtol=RTOL, atol=ATOL
    )
    got = jax.grad(loss(packed), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(alone), argnums=(0, 1, 2))(q, k, v)
    for name, g_, w in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(g_, w, rtol=RTOL, atol=ATOL, err_msg=name)
