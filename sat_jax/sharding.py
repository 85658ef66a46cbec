"""``sat_jax.sharding``: the stable short name of ``sat_jax.parallel.sharding`` (the same module
object, so ``from sat_jax import sharding`` and ``from sat_jax.parallel import sharding`` agree)."""

import sys

from sat_jax.parallel import sharding as _sharding

sys.modules[__name__] = _sharding
