"""The Transformer: config rules, contract shapes, routing capture/replay, embeddings, metrics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_jax.model import ModelConfig, Transformer, router_shift_ratio, token_logprobs
from sat_jax.model.layers import DenseMLP
from sat_jax.model.moe import MoE

# A non-zero aux coefficient exercises the aux loss; every test builds on this one config so
# jitted functions compile once per model structure.
TINY = ModelConfig.preset("tiny", router_aux_loss_coef=0.01)
LOGICAL_AXES = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "exp", "mlp", "norm"}


# Test inputs come from NumPy and params from the RBG PRNG: both skip the slow XLA compile of
# threefry random ops for every new shape (it dominated this suite's run time).
def _rngs():
    return nnx.Rngs(jax.random.key(0, impl="rbg"))


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _model(**overrides):
    return Transformer(TINY.replace(**overrides), rngs=_rngs())


def _tokens(b=2, t=12, seed=0, vocab=TINY.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


@pytest.fixture(scope="module")
def tiny():
    return Transformer(TINY, rngs=_rngs())


# Jitted entry points shared by the tests, so each model structure compiles once per shape.


@nnx.jit(static_argnames=("dispatch",))
def _forward(model, tokens, mask=None, replay=None, dispatch=None):
    return model.forward(tokens, mask_bt=mask, replay_routing=replay, dispatch=dispatch)


@nnx.jit(static_argnames=("return_routing",))
def _call(model, tokens, return_routing=False):
    return model(tokens, return_routing=return_routing)


@nnx.jit(static_argnames=("dispatch",))
def _loss_and_grads(model, tokens, replay=None, dispatch=None):
    def loss(model):
        out = model.forward(tokens, replay_routing=replay, dispatch=dispatch)
        return jnp.mean(token_logprobs(out.logits_btv, tokens)) + out.aux_loss

    return nnx.value_and_grad(loss)(model)


# Config.


@pytest.mark.parametrize(
    "field,value",
    [
        ("d_model", 0),
        ("num_layers", -1),
        ("num_kv_heads", 3),
        ("head_dim", 15),
        ("num_experts", -2),
        ("num_experts_per_tok", 9),
        ("num_experts_per_tok", 0),
        ("expert_dim", 0),
        ("mlp_only_layers", (5,)),
        ("mlp_only_layers", [0]),
        ("decoder_sparse_step", 0),
        ("rope_theta", 0.0),
        ("rms_norm_eps", 0.0),
        ("dispatch", "megablocks"),
        ("router_aux_loss_coef", -1.0),
        ("dtype", jnp.int32),
        ("param_dtype", "nope"),
        ("max_seq_len", 0),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TINY.replace(**{field: value})


def test_config_is_frozen_and_kw_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.d_model = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig(64, 64)  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("huge")


@pytest.mark.parametrize(
    "overrides,want",
    [
        ({}, (0, 1)),
        ({"num_layers": 6, "decoder_sparse_step": 2}, (1, 3, 5)),
        ({"num_layers": 6, "mlp_only_layers": (0, 3)}, (1, 2, 4, 5)),
        ({"num_layers": 6, "decoder_sparse_step": 3, "mlp_only_layers": (5,)}, (2,)),
        ({"num_experts": 0}, ()),
    ],
)
def test_moe_layer_rule_is_hf_qwen3_moe(overrides, want):
    cfg = TINY.replace(**overrides)
    assert cfg.moe_layer_indices == want
    assert cfg.num_moe_layers == len(want)


def test_presets():
    q = ModelConfig.preset("qwen3_30b_a3b")
    assert (q.num_layers, q.d_model, q.num_heads, q.num_kv_heads, q.head_dim) == (
        48,
        2048,
        32,
        4,
        128,
    )
    assert (q.num_experts, q.num_experts_per_tok, q.expert_dim, q.vocab_size) == (
        128,
        8,
        768,
        151_936,
    )
    assert q.num_moe_layers == 48 and q.norm_topk_prob and not q.tie_embeddings
    assert q.routing_dtype == jnp.uint8
    small = nnx.eval_shape(lambda: Transformer(ModelConfig.preset("small"), rngs=nnx.Rngs(0)))
    total = sum(p.size for p in jax.tree.leaves(nnx.state(small, nnx.Param)))
    assert 80e6 < total < 120e6


# Params.


def test_params_carry_logical_axis_names(tiny):
    params = nnx.state(tiny, nnx.Param)
    for path, var in jax.tree.leaves_with_path(params, is_leaf=lambda v: isinstance(v, nnx.Param)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == var[...].ndim, path
        assert set(axes) <= LOGICAL_AXES, path


def test_tied_embeddings_drop_the_output_head():
    tied, untied = _model(tie_embeddings=True), _model(tie_embeddings=False)
    count = lambda m: sum(p.size for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert tied.lm_head_dv is None
    assert count(untied) - count(tied) == TINY.vocab_size * TINY.d_model
    tokens = _tokens()
    before = _call(tied, tokens)
    tied.embedding_vd[...] = tied.embedding_vd[...] * 2.0  # the output head moves with the table
    assert float(jnp.abs(_call(tied, tokens) - before).max()) > 1e-3


# Contract and routing.


def test_contract_shapes_and_dtypes(tiny):
    tokens = _tokens()
    logits = _call(tiny, tokens)
    assert logits.shape == (2, 12, TINY.vocab_size) and logits.dtype == jnp.float32
    logits2, routing = _call(tiny, tokens, return_routing=True)
    np.testing.assert_array_equal(logits, logits2)
    assert routing.shape == (2, 12, 2, 2) and routing.dtype == jnp.uint8
    assert int(routing.max()) < TINY.num_experts


def test_routing_is_uint16_beyond_256_experts():
    # Shapes and dtypes only, so the model is traced abstractly and never compiled.
    cfg = TINY.replace(num_experts=300, num_experts_per_tok=3, dispatch="dense")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    logits, routing = jax.eval_shape(
        lambda state, t: nnx.merge(graphdef, state)(t, return_routing=True), state, _tokens(t=4)
    )
    assert logits.shape == (2, 4, TINY.vocab_size) and logits.dtype == jnp.float32
    assert routing.shape == (2, 4, 2, 3) and routing.dtype == jnp.uint16


@pytest.mark.parametrize(
    "overrides,num_moe",
    [
        ({"num_layers": 3, "mlp_only_layers": (1,)}, 2),
        ({"num_layers": 4, "decoder_sparse_step": 2}, 2),
    ],
)
def test_dense_layers(overrides, num_moe):
    model = _model(**overrides)
    kinds = [type(layer.mlp) for layer in model.layers]
    cfg = model.config
    assert kinds == [MoE if cfg.is_moe_layer(i) else DenseMLP for i in range(cfg.num_layers)]
    out = _forward(model, _tokens())
    assert out.routing_btlk.shape == (2, 12, num_moe, 2)
    assert out.expert_load_le.shape == (num_moe, TINY.num_experts)


def test_replaying_own_routing_equals_no_replay(tiny):
    tokens = _tokens()
    out = _forward(tiny, tokens)
    replayed = _forward(tiny, tokens, replay=out.routing_btlk)
    np.testing.assert_array_equal(replayed.logits_btv, out.logits_btv)
    np.testing.assert_array_equal(replayed.routing_btlk, out.routing_btlk)


@nnx.jit
def _forward_masked(model, tokens, replay, replay_mask):
    return model.forward(tokens, replay_routing=replay, replay_mask_bt=replay_mask)


def test_a_token_with_replay_off_gets_the_live_routers_experts(tiny):
    """Per-token replay (multi-turn R3): tokens off the replay mask are routed by the live
    router whatever their recorded ids, exactly: replaying the recorded ids where the mask is on
    and the forward's own top-k where it is off gives the same bits."""
    tokens = _tokens()
    own = _forward(tiny, tokens).routing_btlk
    # Other experts everywhere: distinct per token (shift the own set by one expert).
    other = ((own.astype(jnp.int32) + 1) % TINY.num_experts).astype(own.dtype)
    on = jnp.asarray(np.random.default_rng(3).random(tokens.shape) < 0.5).at[:, 0].set(True)
    masked = _forward_masked(tiny, tokens, other, on)
    live = masked.routing_btlk  # the router's own top-k in this forward
    mixed = jnp.where(on[:, :, None, None], other, live)
    explicit = _forward(tiny, tokens, replay=mixed)
    np.testing.assert_array_equal(masked.logits_btv, explicit.logits_btv)
    np.testing.assert_array_equal(masked.routing_btlk, explicit.routing_btlk)
    # The recorded ids of tokens off the mask are not read.
    garbage = jnp.where(on[:, :, None, None], other, (other + 2) % TINY.num_experts)
    again = _forward_masked(tiny, tokens, garbage, on)
    np.testing.assert_array_equal(again.logits_btv, masked.logits_btv)
    # All on = plain replay; all off = no replay; the replayed ids do matter where on.
    all_on = _forward_masked(tiny, tokens, other, jnp.ones(tokens.shape, bool))
    np.testing.assert_array_equal(
        all_on.logits_btv, _forward(tiny, tokens, replay=other).logits_btv
    )
    all_off = _forward_masked(tiny, tokens, other, jnp.zeros(tokens.shape, bool))
    np.testing.assert_array_equal(all_off.logits_btv, _forward(tiny, tokens).logits_btv)
    assert not np.array_equal(masked.logits_btv, all_off.logits_btv)


def test_replaying_other_ids_changes_logits_and_trains_the_router(tiny):
    tokens = _tokens()
    own = _forward(tiny, tokens).routing_btlk
    other = ((own.astype(jnp.int32) + 3) % TINY.num_experts).astype(jnp.uint8)
    replayed = _forward(tiny, tokens, replay=other)
    assert float(jnp.abs(replayed.logits_btv - _forward(tiny, tokens).logits_btv).max()) > 1e-3
    # The routing returned is the router's own top-k; the first MoE layer sees unchanged inputs.
    np.testing.assert_array_equal(replayed.routing_btlk[:, :, 0], own[:, :, 0])
    _, grads = _loss_and_grads(tiny, tokens, replay=other)
    for i in TINY.moe_layer_indices:
        assert float(jnp.abs(grads["layers"][i]["mlp"]["w_router_de"][...]).max()) > 0


def test_replay_shape_is_checked(tiny):
    with pytest.raises(ValueError, match="replay_routing"):
        tiny(_tokens(), replay_routing=jnp.zeros((2, 12, 1, 2), jnp.uint8))


@pytest.mark.parametrize("path", ["ragged", "blocked"])
def test_dispatch_paths_agree_through_the_model(tiny, path):
    # Gradients of every path are compared layer by layer in test_moe.py.
    tokens = _tokens()
    want = _forward(tiny, tokens, dispatch="dense")
    got = _forward(tiny, tokens, dispatch=path)
    np.testing.assert_allclose(got.logits_btv, want.logits_btv, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.routing_btlk, want.routing_btlk)


def test_norm_topk_prob_changes_the_output():
    tokens = _tokens()
    on = _call(_model(norm_topk_prob=True), tokens)
    off = _call(_model(norm_topk_prob=False), tokens)
    assert np.all(np.isfinite(off))
    assert float(jnp.abs(on - off).max()) > 1e-4


def test_right_padding_changes_only_the_statistics(tiny):
    tokens = _tokens()
    full = _forward(tiny, tokens)
    mask = jnp.broadcast_to(jnp.arange(12) < 7, (2, 12))
    padded = _forward(tiny, tokens.at[:, 7:].set(5), mask=mask)
    np.testing.assert_allclose(
        padded.logits_btv[:, :7], full.logits_btv[:, :7], rtol=1e-5, atol=1e-5
    )
    # Load statistics count the 7 valid tokens only: 2 * 7 * K slots per layer.
    np.testing.assert_allclose(padded.expert_load_le.sum(-1), 1.0, rtol=1e-6)
    counts = np.zeros((TINY.num_moe_layers, TINY.num_experts))
    for b, t, layer, k in np.ndindex(2, 7, TINY.num_moe_layers, TINY.num_experts_per_tok):
        counts[layer, full.routing_btlk[b, t, layer, k]] += 1
    np.testing.assert_allclose(
        padded.expert_load_le, counts / counts.sum(-1, keepdims=True), rtol=1e-6
    )


def test_masked_key_is_invisible_and_positions_are_honoured(tiny):
    # Masking token 3 out equals deleting it while keeping everyone's RoPE position.
    tokens = _tokens(b=1)
    keep = np.array([i for i in range(12) if i != 3])
    holed = _forward(tiny, tokens, mask=jnp.arange(12)[None] != 3)
    positions = jnp.asarray(keep[None], jnp.int32)
    deleted = nnx.jit(lambda m, t, p: m.forward(t, positions_bt=p))(
        tiny, tokens[:, keep], positions
    )
    np.testing.assert_allclose(holed.logits_btv[:, keep], deleted.logits_btv, rtol=1e-5, atol=1e-5)


def test_aux_loss_is_weighted_finite_and_differentiable(tiny):
    tokens = _tokens()
    out = _forward(tiny, tokens)
    assert np.isfinite(out.balance_loss) and float(out.balance_loss) >= 0
    np.testing.assert_allclose(out.aux_loss, 0.01 * out.balance_loss, rtol=1e-6)
    np.testing.assert_allclose(out.expert_load_le.sum(-1), 1.0, rtol=1e-6)
    # Same call as the replay test (one compile); the aux loss is part of the loss there.
    value, grads = _loss_and_grads(tiny, tokens, replay=out.routing_btlk)
    assert np.isfinite(value)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


# Metrics.


def test_token_logprobs_matches_reference():
    logits = _normal(1, (2, 3, 7)) * 4
    targets = jnp.array([[0, 6, 3], [1, 1, 2]])
    for temperature in (1.0, 0.7):
        z = np.asarray(logits, np.float64) / temperature
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        want = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
        got = token_logprobs(logits, targets, temperature=temperature)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_router_shift_ratio():
    rec = jnp.array([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]], jnp.uint8)  # [1, 2, 2, 2]
    assert float(router_shift_ratio(rec, rec, jnp.ones((1, 2)))) == 0.0
    swapped = rec[..., ::-1]  # same sets, other order
    assert float(router_shift_ratio(rec, swapped, jnp.ones((1, 2)))) == 0.0
    cur = jnp.array([[[[1, 7], [2, 3]], [[0, 1], [6, 5]]]], jnp.uint8)
    # token 0: layer 0 misses 0, layer 1 none; token 1: layer 0 misses 4 and 5, layer 1 misses 7.
    assert float(router_shift_ratio(rec, cur, jnp.ones((1, 2)))) == pytest.approx(4 / 8)
    assert float(router_shift_ratio(rec, cur, jnp.array([[1, 0]]))) == pytest.approx(1 / 4)
    assert float(router_shift_ratio(rec, cur, jnp.zeros((1, 2)))) == 0.0


def test_router_shift_ratio_of_own_routing_is_zero(tiny):
    out = _forward(tiny, _tokens())
    assert float(router_shift_ratio(out.routing_btlk, out.routing_btlk, jnp.ones((2, 12)))) == 0


_shift_jit = jax.jit(router_shift_ratio)


@settings(max_examples=30, deadline=None)
@given(
    rec=st.lists(st.permutations(range(6)), min_size=6, max_size=6),
    cur=st.lists(st.permutations(range(6)), min_size=6, max_size=6),
    mask=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_router_shift_ratio_matches_set_definition(rec, cur, mask):
    # [B=1, T=3, L=2, K=3]; each row holds distinct experts, as top-k ids do.
    rec_btlk = np.array([r[:3] for r in rec]).reshape(1, 3, 2, 3)
    cur_btlk = np.array([c[:3] for c in cur]).reshape(1, 3, 2, 3)
    missing = slots = 0
    for t in range(3):
        if mask[t]:
            for layer in range(2):
                missing += len(set(rec_btlk[0, t, layer]) - set(cur_btlk[0, t, layer]))
                slots += 3
    want = missing / slots if slots else 0.0
    got = float(_shift_jit(rec_btlk, cur_btlk, np.array([mask])))
    assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("dispatch", ["dense", "blocked"])
def test_numpy_replay_ids_work_under_jit(tiny, dispatch):
    # Recorded routing arrives from the rollout queue as NumPy uint8; the blocked path indexes
    # with the ids, which must become jax arrays before tracing reaches it.
    tokens = _tokens()
    own = np.asarray(_forward(tiny, tokens).routing_btlk)
    graphdef, state = nnx.split(tiny)
    run = jax.jit(
        lambda s: (
            nnx.merge(graphdef, s).forward(tokens, replay_routing=own, dispatch=dispatch).logits_btv
        )
    )
    np.testing.assert_allclose(run(state), _forward(tiny, tokens).logits_btv, rtol=1e-5, atol=1e-5)
