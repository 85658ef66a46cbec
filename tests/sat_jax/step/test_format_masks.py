"""Constrained decoding's masks in the train step (`TrainBatch.format_ids` / `format_masks`,
docs/DESIGN.md §6.6): a constrained token's log-prob is renormalized over its row's ids (the
table bit-packed by `sat_jax.json_mask.MaskTable`), the same one pass and in microbatches on 8
simulated devices, and a batch whose tokens are all free gives bit for bit the step without
the fields."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sat_jax import objectives, sharding
from sat_jax.json_mask import MaskTable
from sat_jax.model import format_allowed, placement
from sat_jax.step import TrainBatch
from tests.sat_jax.step.test_microbatches import EIGHT, MODEL_CFG, ONE, Setup, _batch, _step

V = MODEL_CFG.vocab_size
PPO = objectives.PolicyLossConfig()


@pytest.fixture(scope="module")
def setup() -> Setup:
    mesh1 = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    _, params0 = placement.init_sharded(MODEL_CFG, mesh1, 0)
    return Setup(params0=jax.device_get(params0), batch=_batch(), ref_params={})


def _formats(batch: TrainBatch, shards: int) -> TrainBatch:
    """`batch` with half its completion tokens constrained to one of a few random masks that
    allow the token (each mask a row of a `MaskTable`)."""
    rng = np.random.default_rng(1)
    table = MaskTable(tokenizer=None, vocab_size=V)
    masks = rng.random((5, V)) < 0.3
    ids = np.zeros(batch.tokens.shape, np.int32)
    for b, t in zip(*np.nonzero(np.asarray(batch.loss_mask)), strict=True):
        if rng.random() < 0.5:
            j = int(rng.integers(5))
            allowed = masks[j].copy()
            allowed[batch.tokens[b, t]] = True
            ids[b, t] = table.row("f", (j, int(batch.tokens[b, t])), allowed)
    return batch.replace(format_ids=ids, format_masks=table.packed(shards))


def test_the_packed_table_unpacks_to_its_masks():
    rng = np.random.default_rng(0)
    table = MaskTable(tokenizer=None, vocab_size=V)
    masks = rng.random((3, V)) < 0.5
    rows = [table.row("f", i, m) for i, m in enumerate(masks)]
    assert rows == [1, 2, 3] and table.row("g", 0, masks[1]) == 2  # the same bits: one row
    ids = np.array([[0, 1, 2, 3]])
    got = np.asarray(format_allowed(table.packed(), ids, V))[0]
    np.testing.assert_array_equal(got, np.stack([np.ones(V, bool), *masks]))


def test_constrained_tokens_are_renormalized_over_their_mask(setup):
    batch = _formats(setup.batch, 8)
    params_a, metrics_a = _step(setup, PPO, ONE, 1, batch=batch)
    params_b, metrics_b = _step(setup, PPO, ONE, 1)
    # Renormalizing over fewer ids raises those tokens' log-probs: the ratios move.
    assert metrics_a["ratio_mean"] != pytest.approx(float(metrics_b["ratio_mean"]), rel=1e-3)


@pytest.mark.parametrize("k", [2, 4])
def test_microbatches_on_eight_devices_equal_one_pass(setup, k):
    batch = _formats(setup.batch, 8)
    want = _step(setup, PPO, ONE, 1, batch=batch)
    got = _step(setup, PPO, EIGHT, k, batch=batch)
    for key, value in want[1].items():
        np.testing.assert_allclose(got[1][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_batch_without_constrained_tokens_is_bit_identical(setup):
    free = setup.batch.replace(
        format_ids=np.zeros(setup.batch.tokens.shape, np.int32),
        format_masks=np.zeros((8, -(-V // 32)), np.uint32),
    )
    vocab_mask = np.arange(V) < V - 3
    want = _step(setup, PPO, ONE, 1, vocab_mask=vocab_mask)
    got = _step(setup, PPO, ONE, 1, batch=free, vocab_mask=vocab_mask)
    for key, value in want[1].items():
        np.testing.assert_array_equal(got[1][key], value, err_msg=key)
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_array_equal(g, w)


def test_format_ids_and_table_come_together(setup):
    batch = _formats(setup.batch, 8)
    with pytest.raises(ValueError, match="format_ids and format_masks"):
        _step(setup, PPO, ONE, 1, batch=batch.replace(format_masks=None))
    m = batch.format_masks.shape[0]
    with pytest.raises(ValueError, match=rf"format_ids must lie in \[0, {m}\]"):
        _step(setup, PPO, ONE, 1, batch=batch.replace(format_ids=batch.format_ids + m + 1))
