"""The asynchronous SAT trainer (SPEC §7).

Not built yet: see the README's status table. Imports sat_jax; sat_jax never imports this package.
"""
