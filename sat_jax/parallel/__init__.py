"""Parallelism: how the model and its batches are laid out on a device mesh, and what that costs.

- ``rules``: the mesh axes, ``MeshConfig`` / ``make_mesh``, and the logical-axis rules that map
  every named dimension (parameters, activations, batches) to mesh axes. Knows nothing of the model.
- ``sharding``: the rules applied to the policy's parameters (shardings, sharded initialization).
- ``plan``: per-device memory and compiled cost of a config's train step and serving programs
  (``python -m sat_jax.plan``).

The package imports none of them, so ``sat_jax.model`` can import ``rules`` without a cycle.
"""
