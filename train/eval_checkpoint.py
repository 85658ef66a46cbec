"""``sat-eval --config CFG [dotted.key=value ...] [--step N | --hf DIR] --k K --problems N``:
avg@K, pass@K and greedy accuracy of a policy (also ``python -m train.eval_checkpoint``).

The policy: checkpoint ``N`` of the run (``--step``; default the latest), or the weights of a
Hugging Face directory (``--hf``, e.g. a ``sat-export`` output; its architecture must be the
config's), or, when the run has no checkpoint yet, ``model.hf_path``'s weights. A LoRA run's
checkpoint (``model.lora.rank`` > 0) holds only the adapters: they are joined to the base rebuilt
as the run made it (``train.setup.base_policy``; another base is refused); ``--hf`` of its merged
export is read as a base with fresh (zero) adapters, i.e. exactly the export. The problems: the
arithmetic task's held-out stream, or the first N rows of ``task.path``. Completions go through
the server's decoding core (``train.held_out.Evaluator``), scored by ``task.reward``. Prints a
table and writes every number and completion to ``--out`` (default
``<run_dir>/eval/<step-N|hf>.json``).

Bad input (config error, no checkpoint, a missing step, an HF directory of another architecture)
is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

from flax import nnx

from sat_jax import cli as sat_cli
from sat_jax import sharding
from sat_jax.experiment import ConfigError, ExperimentConfig, load_config
from sat_jax.model import hf, placement
from sat_jax.model.config import runtime_overrides
from sat_jax.tasks import Prompt
from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.pipeline import read_prompts
from train import checkpointing, held_out, setup


class EvalInputError(Exception):
    """Bad input to sat-eval; the message is the one line the CLI prints."""


def problems_of(t: TaskConfig, n: int) -> list[Prompt]:
    """The first ``n`` evaluation problems of the task (file rows lacking a column are skipped)."""
    if t.source == "arithmetic":
        return held_out.held_out_problems(t, n)
    prompts, _ = read_prompts(
        t.path, prompt_key=t.prompt_key, answer_key=t.answer_key, id_key=t.id_key
    )
    return prompts[:n]


def policy_params(
    cfg: ExperimentConfig, *, step: int | None, hf_dir: str | None
) -> tuple[str, nnx.GraphDef, Any]:
    """(label, graphdef, params) of the policy to evaluate (see the module docstring)."""
    mesh = sharding.make_mesh(cfg.train.mesh)
    graphdef, abstract = placement.abstract_model(cfg.model)
    shardings = sharding.param_shardings(abstract, mesh)
    if hf_dir is not None:
        try:
            arch = hf.config_from_dir(hf_dir)
        except (OSError, ValueError) as e:
            raise EvalInputError(f"--hf: {e}") from None
        if arch.replace(**runtime_overrides(cfg.model)) != cfg.model:
            raise EvalInputError(f"--hf: {hf_dir}/config.json is not the config's architecture")
        return "hf", *hf.load_params(hf_dir, cfg.model, shardings)
    _, ckpt_dir, _ = setup.run_paths(cfg)
    try:
        optimizer = cfg.train.optimizer.make(cfg.train.steps)
        base = lambda: setup.base_policy(cfg, mesh)[1]
        step, params = checkpointing.restore_params(
            ckpt_dir, cfg.model, optimizer, mesh, step, base=base
        )
        return f"step-{step}", graphdef, params
    except checkpointing.BaseMismatch as e:
        raise EvalInputError(str(e)) from None
    except checkpointing.CheckpointNotFound as e:
        if step is not None or not cfg.model.hf_path:
            raise EvalInputError(f"--step: {e}" if step is not None else str(e)) from None
    return "base", *hf.load_params(cfg.model.hf_path, cfg.model, shardings)


def cli(argv: list[str] | None = None) -> None:
    """``sat-eval --config CFG [key=value ...] [--step N | --hf DIR] --k K --problems N``."""
    command = sat_cli.Command("sat-eval", __doc__)
    parser = command.parser
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    source.add_argument("--hf", help="a Hugging Face checkpoint directory to evaluate instead")
    parser.add_argument("--k", type=int, default=4, help="samples per problem")
    parser.add_argument("--problems", type=int, default=100, help="how many problems")
    parser.add_argument("--out", help="JSON file (default <run_dir>/eval/<step-N|hf>.json)")
    args = command.parse(sys.argv[1:] if argv is None else argv)
    with command.exit_on(ConfigError, EvalInputError, OSError, ValueError):
        if args.k < 1 or args.problems < 1:
            raise EvalInputError(f"--k and --problems must be >= 1, got {args.k}, {args.problems}")
        cfg = load_config(args.config, args.overrides)
        label, graphdef, params = policy_params(cfg, step=args.step, hf_dir=args.hf)
        problems = problems_of(cfg.task, args.problems)
    evaluator = held_out.Evaluator.from_config(cfg, graphdef)
    result = evaluator.evaluate(params, problems, k=args.k)
    out = pathlib.Path(args.out or os.path.join(setup.run_paths(cfg)[0], "eval", f"{label}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"policy": label, **result.to_json()}, indent=2))
    print(
        f"policy {label}, {args.k} samples per problem\n{result.table()}\nwrote {out}", flush=True
    )


if __name__ == "__main__":
    cli()
