"""LoRA exports of a model read from a local HF checkpoint, with trained-looking (non-zero) B:
the merged export loads in transformers with sat_jax's LoRA logits and keeps every non-target
tensor bit-identical to the original checkpoint while changing the targets; the PEFT adapter loads
with ``peft.PeftModel.from_pretrained`` onto the original checkpoint with the same logits."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.model import LoRAConfig, hf, hf_export, lora, safetensors

ALL_TARGETS = ("attention", "mlp", "experts", "router")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Qwen3-MoE checkpoint (float32) with a dense layer (layer 0) and a MoE layer."""
    pytest.importorskip("transformers")
    from tests.hf_fixtures import make_checkpoint

    path = tmp_path_factory.mktemp("lora_base") / "model"
    make_checkpoint(path, vocab_size=80, mlp_only_layers=[0], seed=5)
    return path


def _lora_params(base_dir: pathlib.Path, targets: tuple[str, ...]):
    """(cfg, graphdef, params): the checkpoint under rank-3 LoRA on ``targets``, every B drawn
    non-zero (as after training) so the adapters change the function."""
    cfg = hf.config_from_dir(base_dir).replace(lora=LoRAConfig(rank=3, alpha=5.0, targets=targets))
    graphdef, params = hf.load_params(base_dir, cfg, lora_rng=1)
    keys = iter(jax.random.split(jax.random.key(2), 64))

    def fill(path, x):
        if str(path[-1].key).endswith("_lora_b"):
            return 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)
        return x

    return cfg, graphdef, jax.tree_util.tree_map_with_path(fill, params)


def _ours(graphdef, params, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens)))


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 80, (2, 11)).astype(np.int32)


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("targets", [("attention", "experts"), ALL_TARGETS])
def test_merged_export_matches_and_leaves_non_targets_bit_identical(base_dir, tmp_path, targets):
    transformers = pytest.importorskip("transformers")
    cfg, graphdef, params = _lora_params(base_dir, targets)
    out = hf_export.export_qwen3_moe(params, cfg, tmp_path / "merged", max_shard_bytes=40_000)

    original, merged = hf.read_checkpoint(base_dir), hf.read_checkpoint(out)
    hf._fuse_experts(original, cfg)  # both in the per-expert hub layout
    hf._fuse_experts(merged, cfg)
    assert sorted(merged) == sorted(original)
    changed = {k for k in original if not np.array_equal(original[k], merged[k])}
    target_names = {
        "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "o_proj"),
        "mlp": ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"),
        "experts": ("mlp.experts.",),
        "router": ("mlp.gate.weight",),
    }
    want = {k for k in original if any(s in k for t in targets for s in target_names[t])}
    assert want and changed == want  # every target changed, nothing else (bit-identical)
    for k in original:
        assert merged[k].dtype == original[k].dtype, k

    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens()
    np.testing.assert_allclose(
        _torch_logits(ref, tokens), _ours(graphdef, params, tokens), rtol=1e-4, atol=1e-4
    )


def test_merged_weight_is_base_plus_scaled_product_in_float32():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 4)), jnp.bfloat16)
    a = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 3)), jnp.bfloat16)
    b = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 4)), jnp.bfloat16)
    got = lora.merged_weight(w, a, b, jnp.float32(0.7))
    f32 = lambda x: np.asarray(x, np.float32)
    want = (f32(w) + 0.7 * np.einsum("eir,ero->eio", f32(a), f32(b))).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("targets", [("attention",), ("attention", "experts"), ALL_TARGETS])
def test_peft_adapter_loads_onto_the_base_with_equal_logits(base_dir, tmp_path, targets):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg, graphdef, params = _lora_params(base_dir, targets)
    out = lora.export_peft_adapter(params, cfg, tmp_path / "adapter", base_model=str(base_dir))
    assert sorted(p.name for p in out.iterdir()) == [
        lora.ADAPTER_CONFIG,
        lora.ADAPTER_WEIGHTS,
    ]
    assert json.loads((out / lora.ADAPTER_CONFIG).read_text())["r"] == 3

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    tokens = _tokens()
    before = _torch_logits(base, tokens)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    # every adapter tensor was read (none missing, none unexpected): PEFT's state dict is ours
    theirs = peft.get_peft_model_state_dict(model)
    written = _read(out / lora.ADAPTER_WEIGHTS)
    assert sorted(theirs) == sorted(written)
    for k, v in theirs.items():
        np.testing.assert_array_equal(v.numpy(), written[k], err_msg=k)

    got = _torch_logits(model, tokens)
    want = _ours(graphdef, params, tokens)
    assert np.abs(want - before).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _read(path: pathlib.Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in safetensors.read_safetensors(path).items()}


def test_peft_adapter_refusals(base_dir, tmp_path):
    cfg = hf.config_from_dir(base_dir)
    _, params = hf.load_params(base_dir, cfg)
    with pytest.raises(lora.AdapterExportError, match="rank > 0"):
        lora.export_peft_adapter(params, cfg, tmp_path / "a")
    lora_cfg, _, lora_params = _lora_params(base_dir, ("attention",))
    # an adapter on a weight PEFT has no name for (here: a made-up one) is refused by name
    lora_params["layers"][1]["attn"]["w_extra_lora_a"] = np.zeros((2, 3), np.float32)
    lora_params["layers"][1]["attn"]["w_extra_lora_b"] = np.zeros((3, 2), np.float32)
    with pytest.raises(lora.AdapterExportError, match="layers/1/attn/w_extra.*merged"):
        lora.export_peft_adapter(lora_params, lora_cfg, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    del lora_params["layers"][1]["attn"]["w_extra_lora_a"]
    del lora_params["layers"][1]["attn"]["w_extra_lora_b"]
    lora_params["lm_head_dv_lora_a"] = np.zeros((2, 3), np.float32)
    with pytest.raises(lora.AdapterExportError, match="lm_head_dv_lora_a.*merged"):
        lora.export_peft_adapter(lora_params, lora_cfg, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        lora.export_peft_adapter(lora_params, lora_cfg, tmp_path / "c")
