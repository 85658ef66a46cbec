"""The wire between the rollout servers and the trainer: its protocol and the admission rule.

- ``proto``: ``rollout.proto`` (package ``satjax.rollout.v1``) and its generated modules;
- ``client``: channels (plaintext or TLS) and the bearer-token metadata every call carries;
- ``routing_codec``: expert ids ↔ the ``Routing`` message (raw uint8/uint16 bytes + shape);
- ``records``: the typed, validated host records (``Trajectory``, ``Group``) a pulled group is
  decoded into once, and their conversion to and from the proto messages;
- ``admission``: the pure admission rule both sides run: which groups a server starts, in which
  order it hands them out, and how the trainer spreads a batch over the fleet
  (docs/DESIGN.md §6.3).

Depends on numpy, protobuf and grpc only: ``train`` and ``rollout_server`` both import it, and it
imports neither (nor ``sat_jax``, nor JetStream).
"""
