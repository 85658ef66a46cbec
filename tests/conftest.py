"""Test-session set-up shared by every test module.

Eight simulated CPU devices let the sharding tests build real meshes; the flag must be set before
jax is first imported, which is why it lives here and not in a fixture.
"""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_enable_x64", False)


# Time limit of tests marked slow (end-to-end runs that start processes); every other test gets
# pyproject's `timeout`. A test's own @pytest.mark.timeout wins over both.
SLOW_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
