"""Every recipe option off ⇒ the train step's loss, metrics and gradients are bit for bit those of
the step before the options existed (``tests/sat_jax/step_golden.py`` wrote them).

With the jax version that wrote the golden file, on a kind of CPU it holds fingerprints of
(``step_golden.host_kind``), every array's SHA-256 must match; with another version or CPU kind
(XLA may round differently) their sums and norms must agree to float32 precision.
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
    hosts = golden["hosts"]
    same_host = golden["jax_version"] == jax.__version__ and step_golden.host_kind() in hosts
    want = hosts[step_golden.host_kind()][name] if same_host else next(iter(hosts.values()))[name]
    assert set(want) <= set(got), set(want) - set(got)
    for key, expected in want.items():
        fp = step_golden.fingerprint(got[key])
        if same_host:
            assert fp["sha256"] == expected["sha256"], (key, fp, expected)
        else:
            np.testing.assert_allclose(
                [fp["sum"], fp["norm"]], [expected["sum"], expected["norm"]], rtol=1e-5, atol=1e-7
            )


def test_every_host_kind_of_the_golden_file_agrees_to_float32_precision(golden: dict) -> None:
    kinds = list(golden["hosts"].values())
    for other in kinds[1:]:
        for name, keys in kinds[0].items():
            for key, expected in keys.items():
                got = other[name][key]
                np.testing.assert_allclose(
                    [got["sum"], got["norm"]],
                    [expected["sum"], expected["norm"]],
                    rtol=1e-5,
                    atol=1e-7,
                )
