"""JetStream rollout server over the sat_jax MoE policy (SPEC §6).

Not built yet: see the README's status table. Imports sat_jax; sat_jax never imports this package.
"""
