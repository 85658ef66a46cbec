"""The asynchronous SAT-GRPO trainer (docs/DESIGN.md §7): ``sat-train --config configs/NAME.yaml [k=v ...]``.

Modules, in data-flow order:

- ``setup``: builders from the config (optimizer, run paths, base policy, batch spec, sampleable
  ids, the server pool).
- ``membership``: the fleet's membership, the trainer's side: which servers are up or down,
  failure streaks and their grace, probing and rejoining, ``servers_file``.
- ``remote``: ``ServerPool``, a ``membership.Membership`` that pulls groups over gRPC (decoded
  and validated once into ``rollout_api.records``), acknowledges them and pushes weights.
- ``senders``: one weights sender per server, each with at most one ``UpdateWeights`` in flight.
- ``pulling``: pull until a batch's worth of groups passes the staleness policy.
- ``batching``: one selection pass over pulled groups (duplicates, staleness), then a fixed-shape
  ``TrainBatch`` with per-row rewards and group ids (the jitted step turns them into GRPO
  advantages) and its ``BatchStats`` with per-token lags.
- ``prefetch``: ``BatchSource``, the next batch made (pulled, assembled, sharded) while the step
  runs.
- ``weight_sync``: background weight pushes to the servers.
- ``skips``: the count and likely cause of consecutive skipped steps (``train.max_skipped_steps``).
- ``peers``: trainer processes watching each other; a lost one stops the rest, naming it.
- ``warmup``: the supervised warm-up of the arithmetic demo (cached).
- ``held_out``: held-out evaluation (avg@K, pass@K, greedy) through the server's decoding core
  (``sat_jax.completions`` over ``sat_jax.decoding``).
- ``eval_checkpoint``: the ``sat-eval`` command: evaluation of a checkpoint or an HF directory.
- ``export``: the ``sat-export`` command: a checkpoint as a Hugging Face directory.
- ``checkpointing``: orbax checkpoints of the train state and the loop's progress; server weights.
- ``metrics``, ``curves``: TensorBoard / JSON-lines / console metrics and ``curves.png``.
- ``local_server``: a rollout server child process for single-machine runs.
- ``main``: the job (build, restore, loop) and the ``sat-train`` command line (also
  ``python -m train``).

Imports sat_jax and rollout_api (the wire), never rollout_server; sat_jax never imports this
package.
"""
