"""``sat-export --config CFG [dotted.key=value ...] --out DIR [--step N] [--adapter]``: a trained
policy as a Hugging Face Qwen3-MoE checkpoint directory (also ``python -m train.export``).

Restores the params of checkpoint ``N`` (default: the run's latest) from the run's checkpoint
directory (``train.setup.run_paths``) and writes them with ``sat_jax.model.hf_export``:
config.json, generation_config.json (the eos ids), safetensors (sharded above
``--max-shard-mb``) and the tokenizer files of ``task.tokenizer_path`` (an HF tokenizer), so
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer`` read it.

With LoRA (``model.lora.rank`` > 0) the checkpoint holds only the adapters: the base is rebuilt
as the run made it (``train.setup.base_policy``; a base other than the run's is refused) and the
export is merged, every adapted weight W + (alpha / rank) · A B and every other tensor the base's
bit for bit. ``--adapter`` writes instead a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors, ``sat_jax.model.lora``) for
``peft.PeftModel.from_pretrained(<the base in transformers>, DIR)``.

Bad input (a config error, no checkpoint, a step that is not there, an output directory that is
not empty, a tokenizer directory without tokenizer files) is one line on stderr and exit code 2,
with nothing written.
"""

from __future__ import annotations

import os
import pathlib
import sys

from sat_jax import cli as sat_cli
from sat_jax import sharding
from sat_jax.experiment import ConfigError, ExperimentConfig, load_config, make_tokenizer
from sat_jax.model import hf_export, lora
from train import checkpointing, setup


class ExportError(Exception):
    """Bad input to the exporter; the message is the one line the CLI prints."""


def stop_ids(cfg: ExperimentConfig) -> tuple[tuple[int, ...], int | None]:
    """(eos ids, bos id) the export records: the tokenizer's stop set (an HF checkpoint's eos set
    and ``rollout.stop_token_ids``), its own eos first; its bos, None when it has none."""
    tok = make_tokenizer(cfg)
    eos = (tok.eos_id, *sorted(tok.stop_ids - {tok.eos_id}))
    return eos, None if tok.bos_id == tok.pad_id else tok.bos_id


def export_run(
    cfg: ExperimentConfig,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    adapter: bool = False,
) -> tuple[int, pathlib.Path]:
    """Exports checkpoint ``step`` (default the latest) of ``cfg``'s run to ``out``: a merged
    HF checkpoint, or with ``adapter`` (LoRA runs only) a PEFT adapter directory.

    Returns:
      (the step exported, the output directory).

    Raises:
      ExportError: no checkpoint, the step is missing, ``out`` is not empty, the tokenizer
        directory has no tokenizer files, ``adapter`` without LoRA, or a LoRA checkpoint whose
        base is not the run's. Nothing is written then.
    """
    _, ckpt_dir, _ = setup.run_paths(cfg)
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not empty")
    if adapter and not cfg.model.lora.rank:
        raise ExportError("--adapter needs a LoRA run (model.lora.rank > 0)")
    tokenizer_dir = cfg.tokenizer_path if cfg.tokenizer_kind == "hf" else None
    if tokenizer_dir and not any(
        (pathlib.Path(tokenizer_dir) / n).is_file() for n in hf_export.TOKENIZER_FILES
    ):
        raise ExportError(f"task.tokenizer_path: no tokenizer files in {tokenizer_dir}")
    mesh = sharding.make_mesh(cfg.train.mesh)
    optimizer = cfg.train.optimizer.make(cfg.train.steps)
    base = lambda: setup.base_policy(cfg, mesh)[1]
    try:
        step, params = checkpointing.restore_params(
            ckpt_dir, cfg.model, optimizer, mesh, step, base=base
        )
    except checkpointing.CheckpointNotFound as e:
        raise ExportError(f"--step: {e}" if step is not None else str(e)) from None
    except checkpointing.BaseMismatch as e:
        raise ExportError(str(e)) from None
    if adapter:
        try:
            lora.export_peft_adapter(params, cfg.model, out, base_model=cfg.model.hf_path)
        except lora.AdapterExportError as e:
            raise ExportError(f"--adapter: {e}") from None
        return step, out
    eos, bos = stop_ids(cfg)
    hf_export.export_qwen3_moe(
        params,
        cfg.model,
        out,
        eos_token_ids=eos,
        bos_token_id=bos,
        tokenizer_dir=tokenizer_dir,
    )
    return step, out


def cli(argv: list[str] | None = None) -> None:
    """``sat-export --config CFG [key=value ...] --out DIR [--step N] [--adapter]``."""
    command = sat_cli.Command("sat-export", __doc__)
    command.parser.add_argument("--out", required=True, help="output directory (new or empty)")
    command.parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    command.parser.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA runs: write a PEFT adapter directory instead of the merged checkpoint",
    )
    args = command.parse(sys.argv[1:] if argv is None else argv)
    with command.exit_on(ConfigError, ExportError, OSError):
        cfg = load_config(args.config, args.overrides)
        step, out = export_run(cfg, args.out, step=args.step, adapter=args.adapter)
    what = "adapter of checkpoint" if args.adapter else "checkpoint"
    print(f"exported {what} {step} to {out}", flush=True)


if __name__ == "__main__":
    cli()
