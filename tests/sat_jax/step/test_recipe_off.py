"""Every recipe option off ⇒ the train step's loss, metrics and gradients are bit for bit those of
the step before the options existed (``tests/sat_jax/step_golden.py`` wrote them).

With the jax version that wrote the golden file, on a kind of CPU it holds fingerprints of
(``step_golden.host_kind``), every array's SHA-256 must match; with another version or CPU kind
(XLA may round differently) their sums and norms must agree to float32 precision
(``_assert_close``).
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
            _assert_close(fp, expected, key)


def test_every_host_kind_of_the_golden_file_agrees_to_float32_precision(golden: dict) -> None:
    kinds = list(golden["hosts"].values())
    for other in kinds[1:]:
        for name, keys in kinds[0].items():
            for key in keys.keys() & other[name].keys():  # later files hold newer metrics too
                _assert_close(other[name][key], keys[key], f"{name} {key}")


def _assert_close(got: dict, want: dict, what: str) -> None:
    """Agreement across CPU kinds or XLA builds, where rounding differs from the first matmul on
    and carries through the forward and backward pass: norms to 2e-5 relative, sums to 1e-4 of
    the array's norm (gradient sums nearly cancel, so their own relative error is meaningless).
    Measured between the two host kinds of the file: at most 6.6e-6 and 3.8e-5."""
    np.testing.assert_allclose(got["norm"], want["norm"], rtol=2e-5, err_msg=what)
    np.testing.assert_allclose(
        got["sum"], want["sum"], rtol=0, atol=1e-4 * want["norm"] + 1e-9, err_msg=what
    )
