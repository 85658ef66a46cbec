"""Every recipe option off ⇒ the train step's loss, metrics and gradients are bit for bit those of
the step before the options existed (``tests/sat_jax/step_golden.py`` wrote them).

With the jax version that wrote the golden file, every array's SHA-256 must match; with another
version (its XLA may round differently) their sums and norms must agree to float32 precision.
Metrics added since are not in the file and are not compared.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.sat_jax import step_golden


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(step_golden.GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(step_golden.CASES))
def test_options_off_give_the_golden_step(golden: dict, name: str) -> None:
    import jax

    got = step_golden.run_case(name)
    want = golden["cases"][name]
    assert set(want) <= set(got), set(want) - set(got)
    same_version = golden["jax_version"] == jax.__version__
    for key, expected in want.items():
        fp = step_golden.fingerprint(got[key])
        if same_version:
            assert fp["sha256"] == expected["sha256"], (key, fp, expected)
        else:
            np.testing.assert_allclose(
                [fp["sum"], fp["norm"]], [expected["sum"], expected["norm"]], rtol=1e-5, atol=1e-7
            )
