"""JetStream rollout server over the sat_jax MoE policy (docs/DESIGN.md §6).

    sat-serve --config configs/arith_tiny.yaml server.port=9000     # or: python -m rollout_server

One process serves, on one gRPC port, JetStream's stock `Orchestrator` (Decode, HealthCheck) and
our `satjax.rollout.v1.Rollout` service (Pull, UpdateWeights, Stats, Health; see
`proto/rollout.proto`). Modules, in data-flow order:

- `jetstream_compat`: the JetStream 0.2.2 fixes; imported before anything from jetstream.
- `jetstream_tokenizer`: JetStream's `Tokenizer` over a `sat_jax.tasks.Tokenizer`.
- `engine`: the JetStream `Engine` over `sat_jax.decoding.DecodeCore` (KV cache, slots,
  hot-swappable weights; per token behavior log-prob, version and routing ids).
- `driver`: the orchestrator `Driver` whose detokenize thread writes each request's per-token
  arrays (allocated once per request) into a finished sample.
- `generation`: a group's G samples (single-turn requests, multi-turn episodes, or HTTP
  sessions), resampled on failure, into a `records.Group` with rewards; reports finished groups.
- `rollout`, `loop_core`, `prompt_book`: the rollout loop's thread (admit → dispatch → collect →
  hand out), the parts and lock it shares with the trainer's side, and the prompts dispatched
  and not acknowledged (re-issued by a restart).
- `delivery`, `group_queue`, `trainer_link`: finished groups → their proto (`records.to_proto`,
  the one conversion) in a bounded queue, leased until acknowledged; Pull, Ack and UpdateWeights.
- `persistence`: the state file (admission's part is `rollout_api.admission`'s `get_state`) so
  a restart loses no prompt.
- `weights`: UpdateWeights' checkpoint-root policy; loading through `sat_jax.params_io`.
- `auth`: the shared-token check of every RPC but the health checks (a gRPC interceptor).
- `service`, `metrics`, `process`: the gRPC servicers, Prometheus gauges, and the running server.
- `loop_stats`: the busy-time accounting in Stats and the gauges (decode seconds, slot-seconds
  idle while admission is closed, CPU and steal seconds).
- `stand_in`: an engine that sleeps per token instead of computing, and its command
  (`python -m rollout_server.stand_in`), for the loop benchmark only.
- `chat`, `http_api`, `http_stream`, `http_sessions`, `sessions`, `session_state`: the
  OpenAI-compatible HTTP endpoint (its schema, the server, streamed replies, the session
  routes) and RL sessions played by external agents (the manager; a session's state and rules).
- `segments`, `json_mask`: a session's forks (`server.http_session_fork`) and `response_format`'s
  engine half (constrained decoding's per-slot formats; the automata are `sat_jax.json_mask`).
- `server`: the `sat-serve` command (config errors are one line and exit 2; also
  `python -m rollout_server`).

The wire (proto, client, routing codec, records) is `rollout_api`, shared with the trainer.

Imports sat_jax; sat_jax never imports this package. Importing the package itself pulls in
nothing heavy, so `rollout_api.client` stays usable without JetStream.
"""
