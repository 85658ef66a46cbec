"""The asynchronous SAT-GRPO trainer (docs/DESIGN.md §7): ``sat-train --config configs/NAME.yaml [k=v ...]``.

Modules, in data-flow order:

- ``setup``: builders from the config (optimizer, run paths, base policy, batch spec, sampleable
  ids, the server pool).
- ``remote``: ``ServerPool``, the rollout servers as one object: a thin front over the parts
  below, each holding the ones it needs (composition, no base class).
- ``membership``: the fleet, the trainer's side: which servers are up or down, draining, joining
  or lagging, failure streaks and their grace, probing and rejoining, giving up.
- ``member``: one server as the pool sees it (the record every part shares).
- ``servers_file``: ``train.client.servers_file``, re-read every few seconds.
- ``fleet_weights``: the pushes: the version every server is wanted to hold, each one's share and
  lease, the fence of deaf servers, the rejoin.
- ``senders``: one weights sender per server, each with at most one ``UpdateWeights`` in flight.
- ``pulls``: one Pull of one server over gRPC (groups decoded and validated once into
  ``rollout_api.records``): its deadline, its outcome, booking its reply.
- ``rotation``, ``pull_scheduler``: which servers a pull asks: in turn; or all at once, each for
  its quota of the batch.
- ``leases``: pulled groups leased until acknowledged; acknowledgements not sent yet; the batch
  being pulled.
- ``pulling``: pull until a batch's worth of groups passes the staleness policy.
- ``batching``: one selection pass over pulled groups (duplicates, staleness), then a fixed-shape
  ``TrainBatch`` with per-row rewards and group ids (the jitted step turns them into GRPO
  advantages) and its ``BatchStats`` with per-token lags.
- ``packing``: the padded batch packed into rows of ``train.row_tokens`` (``train.packing``):
  segment ids, positions, every per-token field moved to ``sat_jax.packing``'s layout.
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
