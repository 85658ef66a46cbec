"""JetStream rollout server over the sat_jax MoE policy (docs/DESIGN.md §6).

    sat-serve --config configs/arith_tiny.yaml server.port=9000     # or: python -m rollout_server

One process serves, on one gRPC port, JetStream's stock `Orchestrator` (Decode, HealthCheck) and
our `satjax.rollout.v1.Rollout` service (Pull, UpdateWeights, Stats, Health; see
`proto/rollout.proto`). Modules, in data-flow order:

- `jetstream_compat`: the JetStream 0.2.2 fixes; imported before anything from jetstream.
- `sampling`, `engine`: the JetStream `Engine` (KV cache, slots, hot-swappable weights; per token
  behavior log-prob, version and routing ids).
- `driver`: the orchestrator `Driver` whose detokenize thread writes each request's per-token
  arrays (allocated once per request) into a finished sample.
- `rollout`, `group_queue`, `persistence`: prompts → groups of G samples → rewards →
  `rollout_api.records.Group` → its proto (`records.to_proto`, the one conversion) in a bounded
  queue, with admission control and a state file so a restart loses no prompt.
- `weights`: UpdateWeights' checkpoint-root policy; loading through `sat_jax.params_io`.
- `service`, `metrics`, `process`: the gRPC servicers, Prometheus gauges, and the running server.
- `server`: the `sat-serve` command (config errors are one line and exit 2).

The wire (proto, client, routing codec, records) is `rollout_api`, shared with the trainer.

Imports sat_jax; sat_jax never imports this package. Importing the package itself pulls in
nothing heavy, so `rollout_api.client` stays usable without JetStream.
"""
