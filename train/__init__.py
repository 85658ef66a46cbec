"""The asynchronous SAT-GRPO trainer (docs/DESIGN.md §7): ``sat-train --config configs/NAME.yaml [k=v ...]``.

Modules, in data-flow order:

- ``setup``: builders from the config (optimizer, run paths, base policy, batch spec, sampleable
  ids, the server pool).
- ``remote``: the rollout servers over gRPC (pull groups, decoded and validated once into
  ``rollout_api.records``; push weights; one retry helper).
- ``pulling``: pull until a batch's worth of groups passes the staleness policy.
- ``batching``: one selection pass over pulled groups (duplicates, staleness), then a fixed-shape
  ``TrainBatch`` with per-row rewards and group ids (the jitted step turns them into GRPO
  advantages) and its ``BatchStats`` with per-token lags.
- ``weight_sync``: background weight pushes to the servers.
- ``warmup``: the supervised warm-up of the arithmetic demo (cached).
- ``evaluation``: held-out evaluation through the server's decoding core (``sat_jax.decoding``).
- ``checkpointing``: orbax checkpoints of the train state and the loop's progress; server weights.
- ``metrics``, ``curves``: TensorBoard / JSON-lines / console metrics and ``curves.png``.
- ``local_server``: a rollout server child process for single-machine runs.
- ``main``: the only imperative code: the loop and the command line.

Imports sat_jax and rollout_api (the wire), never rollout_server; sat_jax never imports this
package.
"""
