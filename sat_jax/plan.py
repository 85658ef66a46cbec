"""``python -m sat_jax.plan``: the stable command and import name of ``sat_jax.parallel.plan``."""

import sys

from sat_jax.parallel import plan as _plan

if __name__ == "__main__":
    sys.exit(_plan.main())
sys.modules[__name__] = _plan
