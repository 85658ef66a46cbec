"""``sat_jax.advantages``: the stable short name of ``sat_jax.objectives.advantages`` (the same
module object)."""

import sys

from sat_jax.objectives import advantages as _advantages

sys.modules[__name__] = _advantages
