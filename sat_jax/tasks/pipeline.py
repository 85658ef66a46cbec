"""Grain prompt pipelines: the arithmetic source and jsonl/parquet prompt files with answers.

Every pipeline is an endless `grain.IterDataset` of `Prompt`s; its iterator's `get_state()` is a
small JSON-able dict, so a consumer that saves it with the prompts it has drawn but not finished
loses no prompt on restart (`iterator.set_state(state)` resumes right after the last drawn one).
"""

from __future__ import annotations

import collections
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

import grain

from sat_jax.tasks.arithmetic import ArithmeticTask
from sat_jax.tasks.config import TaskConfig
from sat_jax.tasks.prompt import Prompt

log = logging.getLogger(__name__)

# Prompts are in memory (a list, or computed from their index), so each is read in microseconds
# on the consumer's thread. Grain's default read options prefetch 500 elements on 16 threads and
# scan that buffer on every `next`: about 1 ms of CPU per prompt drawn, which on a rollout server
# runs on the cores that decode (16 per batch at the main job's size).
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def arithmetic_task(cfg: TaskConfig, *, seed_offset: int) -> ArithmeticTask:
    """The arithmetic problems of `cfg` under seed `cfg.seed + seed_offset`.

    Offsets give disjoint problem streams of one task: the rollout server's prompts use offset 0,
    the trainer's supervised warm-up and held-out evaluation their own.
    """
    if cfg.source != "arithmetic":
        raise ValueError(f"arithmetic problems need task.source 'arithmetic', got {cfg.source!r}")
    return ArithmeticTask(
        seed=cfg.seed + seed_offset,
        min_digits=cfg.min_digits,
        max_digits=cfg.max_digits,
        operators=cfg.operators,
    )


def arithmetic_dataset(task: ArithmeticTask) -> grain.IterDataset:
    """Problems 0, 1, 2, ... of `task`, endlessly."""
    return grain.MapDataset.range(sys.maxsize).map(task.problem).to_iter_dataset(_READ)


def read_prompt_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` file, or of a `.parquet` file (needs pyarrow)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # optional dependency, imported only when used

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            if not isinstance(row, Mapping):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            rows.append(row)
    return rows


def read_prompts(
    path: str, *, prompt_key: str = "prompt", answer_key: str = "answer", id_key: str = "id"
) -> tuple[list[Prompt], int]:
    """The rows of a prompt file as `Prompt`s, and how many rows were skipped for lacking the
    prompt or answer column (counted and logged, never a silent stall).

    Rows without `id_key` get "<file name>:<row number>" as their stable id.

    Raises:
      ValueError: the file has no usable row.
    """
    rows = read_prompt_rows(path)
    name = path.rsplit("/", 1)[-1]
    prompts, missing = [], collections.Counter()
    for n, row in enumerate(rows):
        lacking = [key for key in (prompt_key, answer_key) if key not in row]
        if lacking:
            missing[lacking[0]] += 1
            continue
        row_id = row.get(id_key)
        prompts.append(
            Prompt(
                id=str(row_id) if row_id is not None else f"{name}:{n}",
                text=str(row[prompt_key]),
                answer=str(row[answer_key]),
            )
        )
    what = ", ".join(f"{count} without {key!r}" for key, count in missing.items())
    if not prompts:
        raise ValueError(f"{path}: no prompts ({len(rows)} rows{'; ' + what if what else ''})")
    if missing:
        log.warning("%s: skipped %d of %d rows (%s)", path, missing.total(), len(rows), what)
    return prompts, missing.total()


def file_dataset(
    path: str,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    id_key: str = "id",
    seed: int = 0,
    shuffle: bool = True,
) -> grain.IterDataset:
    """The prompts of `read_prompts`, shuffled once by `seed`, repeated endlessly."""
    prompts, _ = read_prompts(path, prompt_key=prompt_key, answer_key=answer_key, id_key=id_key)
    return _repeat(prompts, seed=seed, shuffle=shuffle)


def _repeat(prompts: list[Prompt], *, seed: int, shuffle: bool) -> grain.IterDataset:
    ds = grain.MapDataset.source(prompts)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None).to_iter_dataset(_READ)


def prompt_source(cfg: TaskConfig) -> tuple[grain.IterDataset, int]:
    """The pipeline `cfg.source` names, and the file rows it skipped (`read_prompts`)."""
    if cfg.source == "arithmetic":
        return arithmetic_dataset(arithmetic_task(cfg, seed_offset=0)), 0
    prompts, skipped = read_prompts(
        cfg.path, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, id_key=cfg.id_key
    )
    return _repeat(prompts, seed=cfg.seed, shuffle=True), skipped


def prompt_dataset(cfg: TaskConfig) -> grain.IterDataset:
    """The pipeline `cfg.source` names."""
    return prompt_source(cfg)[0]
