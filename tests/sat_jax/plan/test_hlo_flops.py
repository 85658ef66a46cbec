"""Matmul FLOPs from optimized HLO: loops times their trip counts, convolutions as XLA counts them.

Programs compiled here on the CPU; the counter reads HLO text, so the same walk applies to
XLA:TPU's (whose dots are mostly convolutions, checked against XLA's count in
tests/sat_jax/plan/test_plan_tpu.py's compiles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from sat_jax.plan import hlo_flops


def _compiled(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(fn).lower(*args).compile()


def _xla(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_a_loop_free_matmul_is_counted_as_xla_counts_it() -> None:
    compiled = _compiled(lambda x, w: x @ w, (32, 64), (64, 16))
    got = hlo_flops.matmul_flops(compiled.as_text())
    assert got.flops == 2 * 32 * 64 * 16 == _xla(compiled)
    assert got.unknown_loops == ()


@pytest.mark.parametrize("length", [1, 3, 48])
def test_a_scan_counts_its_body_times_the_trip_count(length: int) -> None:
    def fn(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    compiled = _compiled(fn, (8, 32), (length, 32, 32))
    got = hlo_flops.matmul_flops(compiled.as_text())
    assert got.flops == length * 2 * 8 * 32 * 32
    assert got.unknown_loops == ()


def test_nested_loops_multiply() -> None:
    def fn(x, ws):
        def outer(h, w):
            inner = jax.lax.fori_loop(0, 5, lambda _, g: g @ w, h)
            return inner, None

        return jax.lax.scan(outer, x, ws)[0]

    compiled = _compiled(fn, (4, 16), (3, 16, 16))
    assert hlo_flops.matmul_flops(compiled.as_text()).flops == 3 * 5 * 2 * 4 * 16 * 16


def test_a_loop_with_a_runtime_bound_counts_once_and_is_reported() -> None:
    def fn(x, w, n):
        return jax.lax.fori_loop(0, n, lambda _, h: h @ w, x)

    args = (
        jax.ShapeDtypeStruct((4, 16), jnp.float32),
        jax.ShapeDtypeStruct((16, 16), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    got = hlo_flops.matmul_flops(jax.jit(fn).lower(*args).compile().as_text())
    assert got.flops == 2 * 4 * 16 * 16 and len(got.unknown_loops) == 1


@pytest.mark.parametrize(
    ("lhs", "rhs", "kwargs"),
    [
        ((2, 3, 10, 10), (4, 3, 3, 3), {"padding": "SAME"}),
        ((2, 3, 10, 10), (4, 3, 3, 3), {"padding": "VALID", "window_strides": (2, 2)}),
        ((1, 4, 9, 9), (4, 1, 3, 3), {"padding": "SAME", "feature_group_count": 4}),
        ((1, 2, 7, 7), (3, 2, 2, 2), {"padding": ((1, 1), (0, 2)), "rhs_dilation": (2, 1)}),
        ((1, 2, 5, 5), (3, 2, 3, 3), {"padding": ((2, 2), (1, 1)), "lhs_dilation": (2, 2)}),
    ],
)
def test_convolutions_follow_xlas_formula(lhs, rhs, kwargs) -> None:
    kwargs = {"window_strides": (1, 1), **kwargs}

    def fn(x, k):
        return jax.lax.conv_general_dilated(x, k, **kwargs)

    compiled = _compiled(fn, lhs, rhs)
    assert "convolution(" in compiled.as_text()
    assert hlo_flops.matmul_flops(compiled.as_text()).flops == _xla(compiled)


def test_a_kernels_cost_estimate_is_its_flops() -> None:
    text = """HloModule m, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

ENTRY %main.1 (a.1: f32[4,8]) -> f32[4,8] {
  %a.1 = f32[4,8]{1,0} parameter(0)
  ROOT %k.1 = f32[4,8]{1,0} custom-call(%a.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"cost_estimate":{"flops":"1234","transcendentals":"0"}}}
}
"""
    assert hlo_flops.matmul_flops(text).flops == 1234
