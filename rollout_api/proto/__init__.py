"""Generated gRPC modules of `rollout.proto` (package satjax.rollout.v1); do not edit them."""
