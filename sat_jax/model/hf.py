"""Import Hugging Face Qwen3-MoE checkpoints (config.json + safetensors) and tokenizers.

    model = load_qwen3_moe(path)          # an NNX Transformer holding the weights; model.config
    logits = model(tokens)                # int32 [B, T] -> float32 [B, T, V]

Safetensors files (``model.safetensors`` or the shards listed in ``model.safetensors.index.json``)
are read with a small memory-mapped reader (the format is a JSON header and raw little-endian
arrays), so bfloat16 checkpoints load without torch and without the ``safetensors`` package.
Both HF layouts of the experts are accepted: one tensor per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, the hub format) and the fused
``mlp.experts.gate_up_proj`` [E, 2F, D] / ``mlp.experts.down_proj`` [E, D, F].

HF stores linear weights as [out, in]; ours are [in, out] with heads split out, e.g.
q_proj [N·H, D] -> w_q_dnh [D, N, H] and o_proj [D, N·H] -> w_o_nhd [N, H, D].

With LoRA (``model.lora.rank`` > 0) the checkpoint is the base: its LoRA adapters are not read but
made fresh (``load_params``), so the loaded model computes the checkpoint's function.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from sat_jax import sharding
from sat_jax.model import lora, placement, safetensors
from sat_jax.model.config import ModelConfig
from sat_jax.model.layers import is_lora_path
from sat_jax.model.transformer import Transformer

# Config fields that must hold these values (anything else is a feature we do not implement).
_REQUIRED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "rope_scaling": None,
}


def read_checkpoint(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of a directory's ``model.safetensors`` or its sharded index."""
    path = pathlib.Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(safetensors.read_safetensors(path / name))
    return tensors


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Maps an HF Qwen3-MoE ``config.json`` dict to a ``ModelConfig``.

    Raises:
      ValueError: naming the field, for a different model type or a feature not implemented
        (rope scaling, attention bias, sliding window, another activation).
    """
    if hf.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise ValueError(f"config.json model_type is {hf['model_type']!r}, expected 'qwen3_moe'")
    for field, value in _REQUIRED.items():
        if hf.get(field, value) != value:
            raise ValueError(f"config.json {field}={hf[field]!r} is not supported (need {value!r})")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json rope_parameters.rope_type={rope['rope_type']!r} is not "
            "supported (need 'default')"
        )
    theta = hf.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise ValueError("config.json has neither num_experts nor num_local_experts")
    heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        num_experts=num_experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        expert_dim=hf["moe_intermediate_size"],
        dense_dim=hf["intermediate_size"],
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 32768),
        router_aux_loss_coef=0.0,
    )
    return ModelConfig(**{**fields, **overrides})


def config_from_dir(path: str | pathlib.Path, **overrides: Any) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory's ``config.json``, with ``hf_path`` set to it.

    Raises:
      FileNotFoundError: the directory has no config.json.
      ValueError: the config is not a supported Qwen3-MoE one (see ``config_from_hf``).
    """
    path = pathlib.Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        hf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}/config.json is not JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{path}/config.json is not a JSON object")
    try:
        return config_from_hf(hf, **{"hf_path": str(path), **overrides})
    except KeyError as e:
        raise ValueError(f"{path}/config.json lacks {e.args[0]!r}") from e


# Our layout of one HF tensor, both ways: (to_ours(hf_view, our_shape), to_hf(ours)). Every
# to_ours is a transpose/reshape of the memory-mapped array, i.e. a view: nothing is read until a
# device's slice of it is indexed.
_Layout = tuple[Callable[[np.ndarray, tuple[int, ...]], np.ndarray], Callable[[Any], Any]]
_SAME: _Layout = (lambda w, s: w, lambda x: x)
_T: _Layout = (lambda w, s: w.T, lambda x: x.T)
# q/k/v_proj [N·H, D] <-> [D, N, H].
_HEADS_OUT: _Layout = (
    lambda w, s: w.reshape(s[1], s[2], s[0]).transpose(2, 0, 1),
    lambda x: x.transpose(1, 2, 0).reshape(x.shape[1] * x.shape[2], x.shape[0]),
)
# o_proj [D, N·H] <-> [N, H, D].
_HEADS_IN: _Layout = (
    lambda w, s: w.reshape(s[2], s[0], s[1]).transpose(1, 2, 0),
    lambda x: x.transpose(2, 0, 1).reshape(x.shape[2], x.shape[0] * x.shape[1]),
)
_TOP_LEVEL: dict[tuple[str, ...], tuple[str, _Layout]] = {
    ("embedding_vd",): ("model.embed_tokens.weight", _SAME),
    ("lm_head_dv",): ("lm_head.weight", _T),
    ("final_norm", "scale"): ("model.norm.weight", _SAME),
}
_PER_LAYER: dict[tuple[str, ...], tuple[str, _Layout]] = {
    ("attn_norm", "scale"): ("input_layernorm.weight", _SAME),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", _SAME),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", _SAME),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", _SAME),
    ("attn", "w_q_dnh"): ("self_attn.q_proj.weight", _HEADS_OUT),
    ("attn", "w_k_dgh"): ("self_attn.k_proj.weight", _HEADS_OUT),
    ("attn", "w_v_dgh"): ("self_attn.v_proj.weight", _HEADS_OUT),
    ("attn", "w_o_nhd"): ("self_attn.o_proj.weight", _HEADS_IN),
    ("mlp", "w_router_de"): ("mlp.gate.weight", _T),
    ("mlp", "w_gate_df"): ("mlp.gate_proj.weight", _T),
    ("mlp", "w_up_df"): ("mlp.up_proj.weight", _T),
    ("mlp", "w_down_fd"): ("mlp.down_proj.weight", _T),
}
# Our stacked expert weights [E, ...] <- one HF tensor per expert, each transposed.
_EXPERTS = {"w_gate_edf": "gate_proj", "w_up_edf": "up_proj", "w_down_efd": "down_proj"}


def hf_names(path: tuple[Any, ...], num_experts: int) -> tuple[list[str], _Layout]:
    """HF tensor names of one of our parameter paths and their layout.

    One name for every parameter except the routed experts' stacked weights, which take one HF
    tensor per expert (the hub layout), ``_T`` each.
    """
    path = tuple(str(k) for k in path)
    if path in _TOP_LEVEL:
        name, layout = _TOP_LEVEL[path]
        return [name], layout
    if len(path) > 2 and path[0] == "layers":
        p, rest = f"model.layers.{path[1]}.", path[2:]
        if rest in _PER_LAYER:
            name, layout = _PER_LAYER[rest]
            return [p + name], layout
        if len(rest) == 2 and rest[0] == "mlp" and rest[1] in _EXPERTS:
            proj = _EXPERTS[rest[1]]
            return [f"{p}mlp.experts.{e}.{proj}.weight" for e in range(num_experts)], _T
    raise ValueError(f"no HF source known for parameter {'/'.join(path)}")


class _LazyParam:
    """One parameter as views of memory-mapped checkpoint tensors; ``read(index)`` copies only
    that slice (for stacked experts, only the experts in the slice are touched)."""

    def __init__(self, views: list[np.ndarray], shape: tuple[int, ...], stacked: bool):
        self.views, self.shape, self.stacked = views, shape, stacked

    def read(self, index: tuple[slice, ...], dtype: Any) -> np.ndarray:
        if not self.stacked:
            return np.array(self.views[0][index], dtype=dtype)
        experts = range(self.shape[0])[index[0]]
        out = np.empty((len(experts), *self.views[0][index[1:]].shape), dtype)
        for j, e in enumerate(experts):
            out[j] = self.views[e][index[1:]]
        return out


def _fuse_experts(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Splits the fused expert layout into the per-expert hub names, in place (views, no copy)."""
    f = cfg.expert_dim
    for name in [k for k in tensors if k.endswith("mlp.experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :f]
            tensors[f"{prefix}{e}.up_proj.weight"] = gate_up[e, f:]
            tensors[f"{prefix}{e}.down_proj.weight"] = down[e]


def _lazy_params(
    path: pathlib.Path, cfg: ModelConfig, abstract: nnx.State
) -> list[tuple[tuple[Any, ...], jax.ShapeDtypeStruct, _LazyParam]]:
    """(our path, abstract value, lazy source) for every parameter but the LoRA adapters (no
    checkpoint has them); checks names and shapes."""
    tensors = read_checkpoint(path)
    _fuse_experts(tensors, cfg)
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    used: set[str] = set()
    out = []
    for var_path, var in nnx.to_flat_state(abstract):
        want = var.get_value()
        var_path = tuple(var_path)
        if is_lora_path(var_path):
            continue
        where = "/".join(map(str, var_path))
        names, (to_ours, _) = hf_names(var_path, cfg.num_experts)
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"checkpoint {path} lacks {missing[0]} (for {where})")
        stacked = len(names) > 1
        shape = want.shape[1:] if stacked else want.shape
        try:
            views = [to_ours(tensors[n], shape) for n in names]
        except ValueError:
            views = [tensors[names[0]]]
        got = (len(views), *views[0].shape) if stacked else views[0].shape
        if got != want.shape or any(v.shape != views[0].shape for v in views):
            raise ValueError(f"{names[0]} maps to shape {got}, expected {want.shape} for {where}")
        out.append((var_path, want, _LazyParam(views, want.shape, stacked)))
        used.update(names)
    unused = sorted(k for k in tensors if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint {path} has tensors the model does not use: {unused[:5]}")
    return out


def load_params(
    path: str | pathlib.Path, cfg: ModelConfig, shardings: Any = None, lora_rng: int = 0
) -> tuple[nnx.GraphDef, dict]:
    """Reads a checkpoint's weights straight into their target shardings.

    Each parameter is one ``jax.make_array_from_callback``: every device's callback copies only
    its own slice out of the memory-mapped safetensors (stacked experts read only the experts in
    that slice), cast to ``cfg.param_dtype``. No host copy of the whole model is made; the peak
    host memory is one device's slice of one parameter. With LoRA (``cfg.lora.rank`` > 0) the
    checkpoint gives the base and the adapters are fresh (``lora.init_lora``: A random from
    ``lora_rng``, B zero), so the model computes exactly the checkpoint's function.

    Args:
      path: a checkpoint directory (safetensors, single or sharded with an index).
      cfg: the model config (e.g. ``config_from_hf`` of its config.json).
      shardings: a nested dict of ``jax.sharding.Sharding`` per parameter (e.g.
        ``sat_jax.sharding.param_shardings(abstract, mesh)``); default the default device.
      lora_rng: the seed of the LoRA adapters' A.

    Returns:
      ``(graphdef, params)``; ``nnx.merge(graphdef, params)`` is the ``Transformer``.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = []
    for var_path, want, lazy in _lazy_params(pathlib.Path(path), cfg, abstract):
        target = single
        if shardings is not None:
            target = shardings
            for key in var_path:
                target = target[key]
        array = jax.make_array_from_callback(
            want.shape, target, lambda index, lazy=lazy, dt=want.dtype: lazy.read(index, dt)
        )
        flat.append((var_path, array))
    params: dict = {}
    for var_path, array in flat:
        node = params
        for key in var_path[:-1]:
            node = node.setdefault(key, {})
        node[var_path[-1]] = array
    if cfg.lora.rank:
        adapter_sh = lora.split_lora(shardings)[1] if shardings is not None else single
        params = lora.join_lora(params, lora.init_lora(cfg, adapter_sh, lora_rng))
    return graphdef, params


def load_qwen3_moe(
    path: str | pathlib.Path, *, mesh: jax.sharding.Mesh | None = None, **config_overrides: Any
) -> Transformer:
    """Loads an HF Qwen3-MoE checkpoint directory into a ``Transformer``.

    The module is built abstractly (``nnx.eval_shape``, no random init) and filled with the
    checkpoint's tensors cast to ``param_dtype`` (``load_params``). Every parameter must be found
    with the expected shape, and every checkpoint tensor must be used (``lm_head.weight`` may be
    absent or ignored when the embeddings are tied).

    Args:
      path: a directory with ``config.json`` and safetensors weights.
      mesh: place each parameter on its sharding under ``sat_jax.sharding``'s logical-axis rules
        over this mesh; default the default device.
      **config_overrides: ``ModelConfig`` fields to change (e.g. ``dispatch``, ``dtype``).

    Returns:
      The ``Transformer``; its ``config`` is the mapped ``ModelConfig``.
    """
    cfg = config_from_dir(path, **config_overrides)
    shardings = None
    if mesh is not None:
        shardings = sharding.param_shardings(placement.abstract_model(cfg)[1], mesh)
    graphdef, params = load_params(path, cfg, shardings)
    return nnx.merge(graphdef, params)


def load_tokenizer(path: str | pathlib.Path) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(path)``; needs the optional ``transformers``."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            "load_tokenizer needs the optional 'transformers' package (pip install transformers)"
        ) from e
    return AutoTokenizer.from_pretrained(str(path))
