"""The trainer processes these tests start share a persistent XLA compilation cache, so a restarted
trainer (and a re-run) skips most compilation on this 2-core machine. The test process itself keeps
JAX's defaults: a conftest must not change compilation for the other packages' tests."""

import pathlib
import tempfile

JAX_CACHE = pathlib.Path(tempfile.gettempdir()) / "sat_jax_train_test_jax_cache"
