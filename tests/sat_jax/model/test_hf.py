"""HF Qwen3-MoE import: logits and routed expert sets match transformers on tiny random checkpoints."""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sat_jax.model import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# float32 on both sides; the remaining differences are summation order (~1e-6).
LOGITS_RTOL, LOGITS_ATOL = 1e-4, 1e-4
# A routed set may differ only where HF's K-th and (K+1)-th probabilities are this close (a tie).
TIE_MARGIN = 1e-5

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    num_experts=6,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    norm_topk_prob=False,
    tie_word_embeddings=False,
)
CASES = {
    # GQA with head_dim != hidden / heads, untied, no renormalization; one safetensors file.
    "gqa_untied_norm_false": dict(),
    # Renormalized top-k, tied embeddings, a forced-dense layer; saved as several shards.
    "tied_norm_true_mlp_only_sharded": dict(
        norm_topk_prob=True,
        tie_word_embeddings=True,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        rope_theta=500.0,
    ),
    # MoE every other layer, multi-head attention, default head_dim.
    "sparse_step_2_mha": dict(
        decoder_sparse_step=2,
        num_hidden_layers=4,
        num_key_value_heads=4,
        head_dim=None,
        num_experts=8,
        num_experts_per_tok=3,
    ),
}


def _make_checkpoint(path: pathlib.Path, overrides: dict, *, dtype=None, shard: bool = False):
    cfg_kwargs = {**BASE, **overrides}
    if cfg_kwargs.get("head_dim") is None:
        cfg_kwargs.pop("head_dim")
    config = transformers.Qwen3MoeConfig(**cfg_kwargs)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # HF's init (std 0.02) makes near-uniform logits; widen it.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.15)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size="40KB" if shard else "1GB")
    return model


def _hf_topk_sets(router_logits: tuple, k: int, b: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's own selection: top-k of softmax(router logits); ids [B, T, L, K] and K/K+1 margins."""
    probs = torch.stack([torch.softmax(r.float(), dim=-1) for r in router_logits], dim=1)
    top = torch.topk(probs, k + 1, dim=-1)
    ids = top.indices[..., :k].numpy().reshape(b, t, len(router_logits), k)
    margin = (top.values[..., k - 1] - top.values[..., k]).numpy().reshape(b, t, -1)
    return ids, margin


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_routing_match_transformers(tmp_path: pathlib.Path, case: str) -> None:
    overrides = CASES[case]
    ref = _make_checkpoint(tmp_path, overrides, shard="sharded" in case)
    if "sharded" in case:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1

    model = hf.load_qwen3_moe(tmp_path)
    cfg = model.config
    assert cfg.norm_topk_prob == overrides.get("norm_topk_prob", False)
    assert cfg.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert (model.lm_head_dv is None) == cfg.tie_embeddings
    assert cfg.mlp_only_layers == tuple(overrides.get("mlp_only_layers", ()))
    assert cfg.head_dim == (BASE["head_dim"] if "head_dim" not in overrides else 32 // 4)

    b, t = 2, 10
    tokens = np.random.default_rng(0).integers(0, BASE["vocab_size"], (b, t)).astype(np.int32)
    with torch.no_grad():
        out = ref(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, return_routing=True))
    logits, routing = jax.device_get(fwd(state, tokens))

    np.testing.assert_allclose(logits, out.logits.numpy(), rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
    k = cfg.num_experts_per_tok
    assert routing.shape == (b, t, cfg.num_moe_layers, k)
    assert len(out.router_logits) == cfg.num_moe_layers
    want, margin = _hf_topk_sets(out.router_logits, k, b, t)
    same = np.all(np.sort(routing.astype(np.int64), -1) == np.sort(want, -1), axis=-1)
    assert np.all(same | (margin < TIE_MARGIN)), f"routed sets differ at {np.argwhere(~same)}"
    assert same.mean() > 0.95


def test_bfloat16_checkpoint_loads_exact_values(tmp_path: pathlib.Path) -> None:
    ref = _make_checkpoint(tmp_path, {}, dtype=torch.bfloat16)
    model = hf.load_qwen3_moe(tmp_path)
    sd = ref.state_dict()
    np.testing.assert_array_equal(
        np.asarray(model.embedding_vd[...]), sd["model.embed_tokens.weight"].float().numpy()
    )
    np.testing.assert_array_equal(
        np.asarray(model.layers[0].mlp.w_down_efd[...][3]),
        sd["model.layers.0.mlp.experts.down_proj"][3].float().numpy().T
        if "model.layers.0.mlp.experts.down_proj" in sd
        else sd["model.layers.0.mlp.experts.3.down_proj.weight"].float().numpy().T,
    )
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].attn.w_q_dnh[...]),
        sd["model.layers.1.self_attn.q_proj.weight"].float().numpy().T.reshape(32, 4, 12),
    )


def _write_config(path: pathlib.Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("ckpt")
    _make_checkpoint(path, {})
    return path


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
        ({"model_type": "llama"}, "model_type"),
    ],
)
def test_unsupported_config_is_a_clear_error(
    tmp_path: pathlib.Path, checkpoint: pathlib.Path, changes: dict, field: str
) -> None:
    for f in checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _write_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=field):
        hf.load_qwen3_moe(tmp_path)


def test_missing_and_extra_tensors_are_errors(
    tmp_path: pathlib.Path, checkpoint: pathlib.Path
) -> None:
    for f in checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _write_config(tmp_path, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"lacks model\.layers\.2\."):
        hf.load_qwen3_moe(tmp_path)
    _write_config(tmp_path, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.1\."):
        hf.load_qwen3_moe(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.load_qwen3_moe(tmp_path / "nowhere")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf.load_qwen3_moe(tmp_path)


def test_load_tokenizer(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "1": 1, "+": 2, "2": 3, "=": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]"
    ).save_pretrained(tmp_path)
    tok = hf.load_tokenizer(tmp_path)
    assert tok("1+2=")["input_ids"] == [1, 2, 3, 4]
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="optional 'transformers'"):
        hf.load_tokenizer(tmp_path)


def test_fused_expert_layout_loads_like_the_hub_layout(
    tmp_path: pathlib.Path, checkpoint: pathlib.Path
) -> None:
    """transformers>=5 keeps experts fused in memory ([E, 2F, D] gate_up, [E, D, F] down)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(checkpoint)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if "model.layers.0.mlp.experts.gate_up_proj" not in sd:
        pytest.skip("this transformers version keeps experts unfused")
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    fused = nnx.to_pure_dict(nnx.state(hf.load_qwen3_moe(tmp_path)))
    hub = nnx.to_pure_dict(nnx.state(hf.load_qwen3_moe(checkpoint)))
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(hub), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
