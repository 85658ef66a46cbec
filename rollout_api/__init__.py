"""The wire between the rollout servers and the trainer: its protocol and nothing else.

- ``proto``: ``rollout.proto`` (package ``satjax.rollout.v1``) and its generated modules;
- ``client``: channels (plaintext or TLS) and the bearer-token metadata every call carries;
- ``routing_codec``: expert ids ↔ the ``Routing`` message (raw uint8/uint16 bytes + shape);
- ``records``: the typed, validated host records (``Trajectory``, ``Group``) a pulled group is
  decoded into once, and their conversion to and from the proto messages.

Depends on numpy, protobuf and grpc only: ``train`` and ``rollout_server`` both import it, and it
imports neither (nor ``sat_jax``, nor JetStream).
"""
