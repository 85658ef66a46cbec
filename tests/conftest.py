"""Test-session set-up shared by every test module.

Eight simulated CPU devices let the sharding tests build real meshes; the flag must be set before
jax is first imported, which is why it lives here and not in a fixture.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_enable_x64", False)
