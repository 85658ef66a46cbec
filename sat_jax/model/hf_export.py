"""Export a policy back to the Hugging Face Qwen3-MoE format (the inverse of ``sat_jax.model.hf``).

    export_qwen3_moe(params, cfg, "runs/x/hf", eos_token_ids=[151645], tokenizer_dir=src)

writes ``config.json``, ``generation_config.json`` (the eos ids), the weights as safetensors in the
hub layout (one tensor per expert; a single ``model.safetensors``, or shards with
``model.safetensors.index.json`` above ``max_shard_bytes``) and copies the tokenizer files, so
``transformers.AutoModelForCausalLM.from_pretrained(out)``, vLLM or lm-eval read it, and
``hf.load_params(out, cfg)`` gives back exactly ``params``. The tensor layouts come from the one
table in ``sat_jax.model.hf`` (``hf_names``), used in both directions.

With LoRA (``cfg.lora.rank`` > 0) the export is merged: every adapted weight is written as
W + (alpha / rank) · A B, computed in float32 and cast to W's dtype (``lora.merged_weight``), and every
other tensor (norms, embeddings, router when not a target, lm_head) is the base's, bit for bit; the
adapters themselves are not written, so the directory is a plain Qwen3-MoE checkpoint. (A PEFT
adapter directory instead: ``sat_jax.model.lora``.)

The files are written one parameter at a time: the host holds one parameter (one stacked expert
weight at most), never the whole model. Single process only (``jax.device_get`` of each leaf).
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax.model import hf, lora, safetensors
from sat_jax.model.config import LoRAConfig, ModelConfig
from sat_jax.model.layers import LORA_A, LORA_B
from sat_jax.model.transformer import Transformer

# Default shard size, as transformers' save_pretrained.
MAX_SHARD_BYTES = 5 * 2**30
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def config_to_hf(
    cfg: ModelConfig, *, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` (``hf.config_from_hf`` maps it back to ``cfg``'s
    architecture)."""
    if cfg.num_experts == 0:
        raise ValueError("a Qwen3-MoE export needs num_experts > 0")
    eos = list(eos_token_ids)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.dense_dim,
        "moe_intermediate_size": cfg.expert_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "norm_topk_prob": cfg.norm_topk_prob,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "dtype": np.dtype(cfg.param_dtype).name,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }


class _Merged:
    """A LoRA target of the export: shape and dtype of the base weight, merged on ``value()``
    (so only the tensor being written is ever merged)."""

    def __init__(self, w: Any, a: Any, b: Any, scale: float):
        self.w, self.a, self.b, self.scale = w, a, b, scale
        self.shape, self.dtype = w.shape, w.dtype

    def value(self) -> jax.Array:
        return lora.merged_weight(self.w, self.a, self.b, jnp.float32(self.scale))


def _leaves(params: dict, cfg: ModelConfig) -> Iterator[tuple[tuple[Any, ...], Any, Any]]:
    """(our path, the leaf of ``params``, its abstract value) in the model's parameter order; with
    LoRA the adapters are left out and each adapted weight is a `_Merged`."""
    base_cfg = cfg.replace(lora=LoRAConfig())
    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(base_cfg, rngs=nnx.Rngs(0))))
    for var_path, var in nnx.to_flat_state(abstract):
        parent = params
        for key in var_path[:-1]:
            parent = parent[key]
        name = var_path[-1]
        leaf = parent[name]
        if cfg.lora.rank and f"{name}{LORA_A}" in parent:
            leaf = _Merged(
                leaf, parent[f"{name}{LORA_A}"], parent[f"{name}{LORA_B}"], cfg.lora.scale
            )
        yield tuple(var_path), leaf, var.get_value()


def _hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) of every tensor, one parameter on the host at a time."""
    for var_path, leaf, _ in _leaves(params, cfg):
        value = np.asarray(jax.device_get(leaf.value() if isinstance(leaf, _Merged) else leaf))
        names, (_, to_hf) = hf.hf_names(var_path, cfg.num_experts)
        parts = [value[e] for e in range(len(names))] if len(names) > 1 else [value]
        for name, part in zip(names, parts, strict=True):
            yield name, np.ascontiguousarray(to_hf(part))


def _shard_plan(
    entries: Sequence[tuple[str, tuple[int, ...], np.dtype]], max_shard_bytes: int
) -> list[list[int]]:
    """Consecutive groups of entry indices, each at most ``max_shard_bytes`` (or one tensor)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def _entries(params: dict, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of every HF tensor, from shapes alone."""
    out = []
    for var_path, leaf, want in _leaves(params, cfg):
        dtype = np.dtype(leaf.dtype)
        names, (_, to_hf) = hf.hf_names(var_path, cfg.num_experts)
        shape = want.shape[1:] if len(names) > 1 else want.shape
        hf_shape = jax.eval_shape(to_hf, jax.ShapeDtypeStruct(shape, dtype)).shape
        out.extend((name, tuple(hf_shape), dtype) for name in names)
    return out


def write_weights(
    params: dict, cfg: ModelConfig, out: pathlib.Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Writes the safetensors file(s) (and the index when sharded); returns the file names."""
    entries = _entries(params, cfg)
    groups = _shard_plan(entries, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    tensors = _hf_tensors(params, cfg)
    weight_map = {}
    for name, group in zip(files, groups, strict=True):
        with open(out / name, "wb") as f:
            f.write(safetensors.safetensors_header([entries[i] for i in group]))
            for i in group:
                tensor_name, array = next(tensors)
                if (tensor_name, array.shape) != entries[i][:2]:
                    raise AssertionError(f"export order broke at {tensor_name}")
                f.write(array.tobytes())
                weight_map[tensor_name] = name
    if len(files) > 1:
        total = sum(math.prod(s) * d.itemsize for _, s, d in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def export_qwen3_moe(
    params: Any,
    cfg: ModelConfig,
    out: str | pathlib.Path,
    *,
    eos_token_ids: Sequence[int] = (),
    bos_token_id: int | None = None,
    tokenizer_dir: str | pathlib.Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> pathlib.Path:
    """Writes ``params`` as a Hugging Face Qwen3-MoE checkpoint directory.

    Args:
      params: the policy's params, a nested dict (``nnx.to_pure_dict``) or an ``nnx.State``, in
        any dtype (written as they are; ``config.json``'s dtype is ``cfg.param_dtype``). With
        LoRA, the whole model (base and adapters): the adapted weights are written merged.
      cfg: their model config.
      out: the directory; created, and it must be empty if it exists.
      eos_token_ids: the stop ids (``generation_config.json`` and ``config.json``).
      bos_token_id: the tokenizer's BOS id, or None (Qwen has none).
      tokenizer_dir: copy the tokenizer files found there (``TOKENIZER_FILES``).
      max_shard_bytes: above this the weights are split into shards with an index.

    Returns:
      The output directory.

    Raises:
      FileExistsError: ``out`` exists and is not empty.
      ValueError: a model config Qwen3-MoE cannot express (no experts).
    """
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export directory {out} exists and is not empty")
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    config = config_to_hf(cfg, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": config["eos_token_id"], "bos_token_id": bos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_weights(params, cfg, out, max_shard_bytes=max_shard_bytes)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return out


def copy_tokenizer(src: str | pathlib.Path, dst: str | pathlib.Path) -> list[str]:
    """Copies the tokenizer files of ``src`` into ``dst``; returns their names.

    Raises:
      FileNotFoundError: ``src`` holds none of ``TOKENIZER_FILES``.
    """
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not names:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {src}")
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return names
