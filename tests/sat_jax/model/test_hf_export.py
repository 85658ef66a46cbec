"""HF export and sharded import: load(export(p)) == p exactly, transformers reads the export with
the same logits, and a sharded load puts every parameter on its rule's sharding (8 simulated CPU
devices, tests/conftest.py)."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax import sharding
from sat_jax.model import ModelConfig, Transformer, hf, hf_export, placement

# Tied and untied, a forced-dense layer, bfloat16 storage: every table entry gets exercised.
CASES = {
    "untied_f32": ModelConfig.preset("tiny", vocab_size=96, mlp_only_layers=(1,), num_layers=3),
    "tied_bf16": ModelConfig.preset(
        "tiny", tie_embeddings=True, norm_topk_prob=False, param_dtype=jnp.bfloat16
    ),
}


def _random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed))))


def _assert_same(a: dict, b: dict) -> None:
    flat_a = jax.tree_util.tree_leaves_with_path(a)
    flat_b = jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("max_shard_bytes", [hf_export.MAX_SHARD_BYTES, 40_000])
def test_load_of_export_is_exact(tmp_path: pathlib.Path, case: str, max_shard_bytes: int) -> None:
    cfg = CASES[case]
    params = _random_params(cfg)
    out = hf_export.export_qwen3_moe(
        params, cfg, tmp_path / "hf", eos_token_ids=[5, 7], max_shard_bytes=max_shard_bytes
    )
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < hf_export.MAX_SHARD_BYTES)
    assert sharded == (not (out / "model.safetensors").exists())
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == [5, 7]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [5, 7]
    back_cfg = hf.config_from_hf(config, param_dtype=cfg.param_dtype)
    assert back_cfg.replace(router_aux_loss_coef=0.0) == cfg.replace(router_aux_loss_coef=0.0)
    _, loaded = hf.load_params(out, back_cfg)
    _assert_same(loaded, params)


def test_export_refuses_a_non_empty_directory_and_missing_tokenizer(
    tmp_path: pathlib.Path,
) -> None:
    cfg = CASES["untied_f32"]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        hf_export.export_qwen3_moe(_random_params(cfg), cfg, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        hf_export.copy_tokenizer(tmp_path / "x", tmp_path)
    with pytest.raises(ValueError, match="num_experts > 0"):
        hf_export.config_to_hf(cfg.replace(num_experts=0))


def test_sharded_load_places_every_param_on_its_rule(tmp_path: pathlib.Path) -> None:
    cfg = CASES["untied_f32"]
    params = _random_params(cfg)
    out = hf_export.export_qwen3_moe(params, cfg, tmp_path / "hf", max_shard_bytes=40_000)
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1, expert=4, tensor=2))
    model = hf.load_qwen3_moe(out, mesh=mesh)
    loaded = nnx.to_pure_dict(nnx.state(model))
    want = sharding.param_shardings(placement.abstract_model(cfg)[1], mesh)
    _assert_same(loaded, params)
    for (path, array), target in zip(
        jax.tree_util.tree_leaves_with_path(loaded), jax.tree.leaves(want), strict=True
    ):
        assert array.sharding.is_equivalent_to(target, array.ndim), path
    experts = [
        a
        for p, a in jax.tree_util.tree_leaves_with_path(loaded)
        if p[-1].key in ("w_gate_edf", "w_up_edf", "w_down_efd")
    ]
    assert len(experts) == 3 * cfg.num_moe_layers
    for array in experts:  # experts over expert=4, their hidden width over tensor=2
        for shard in array.addressable_shards:
            assert shard.data.shape[0] == cfg.num_experts // 4
            assert shard.data.size * 8 == array.size


def test_transformers_reads_the_export_with_equal_logits(tmp_path: pathlib.Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = CASES["untied_f32"]
    params = _random_params(cfg, seed=3)
    out = hf_export.export_qwen3_moe(
        params, cfg, tmp_path / "hf", eos_token_ids=[1], max_shard_bytes=40_000
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    model = nnx.merge(placement.abstract_model(cfg)[0], params)
    got = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
