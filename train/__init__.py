"""The asynchronous SAT-GRPO trainer (docs/DESIGN.md §7): ``sat-train --config configs/NAME.yaml [k=v ...]``.

Modules, in data-flow order:

- ``remote``: the rollout servers over gRPC (pull groups, push weights, retry while one is down).
- ``batching``: pulled groups → a fixed-shape ``TrainBatch``; per-token lag, the staleness policy,
  GRPO advantages.
- ``warmup``: the supervised warm-up (cached) and held-out greedy accuracy on the arithmetic task.
- ``checkpointing``: orbax checkpoints of the train state and the loop's progress; server weights.
- ``metrics``, ``curves``: TensorBoard / JSON-lines / console metrics and ``curves.png``.
- ``local_server``: a rollout server child process for single-machine runs.
- ``main``: the only imperative code: the loop and the command line.

Imports sat_jax and the rollout server's generated client; sat_jax never imports this package.
"""
