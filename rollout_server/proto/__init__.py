"""The protocol's former home: ``rollout_server.proto.rollout_pb2`` and ``..._pb2_grpc`` are the
modules of ``rollout_api.proto`` (the same module objects), kept for clients written against the
old path. New code imports ``rollout_api.proto``."""

import sys

from rollout_api.proto import rollout_pb2, rollout_pb2_grpc

sys.modules[f"{__name__}.rollout_pb2"] = rollout_pb2
sys.modules[f"{__name__}.rollout_pb2_grpc"] = rollout_pb2_grpc

__all__ = ["rollout_pb2", "rollout_pb2_grpc"]
