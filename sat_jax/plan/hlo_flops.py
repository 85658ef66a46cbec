"""Matmul FLOPs of a compiled XLA program, counted from its optimized HLO with loop trip counts.

XLA's own ``cost_analysis()`` counts the body of a ``while`` loop once, whatever its trip count
(checked on XLA:TPU with libtpu 0.0.42.1: the `tiny` train step with 4 scanned layers reports the
FLOPs of 2; with 2 microbatches, half those of 1). Our train step is loops all the way down (the
microbatch scan, the scanned layers, blockwise attention, the chunked log-probs), so its count
would be a fraction of the work. ``matmul_flops`` walks the optimized per-device HLO instead:

* a ``dot``: 2 · output elements · the product of the lhs contracting dimensions;
* a ``convolution`` (XLA:TPU writes most dots as convolutions): XLA's own formula
  (``HloCostAnalysis::GetConvolutionFlops``), 2 · input features / feature groups · output
  features · batch / batch groups · the valid window positions of every spatial dimension;
* a ``custom-call`` carrying a ``cost_estimate`` (Mosaic kernels: XLA:TPU's grouped matmul for
  ``ragged_dot``, Pallas kernels): its ``flops``;
* every computation a ``fusion``, ``call``, ``async`` or ``conditional`` (its costliest branch)
  runs, once; a ``while`` body, times its trip count, read from the loop condition's
  ``compare(i, constant)`` (jax's ``scan`` and ``fori_loop`` count i from 0). A loop whose bound
  is not a constant counts once and is reported in ``HloFlops.unknown_loops``.

Elementwise work is not counted: the analytic side (``sat_jax.plan.programs``) counts matmuls
only, so the ratio of the two shows recomputation and dense (all-expert) dispatch.
"""

from __future__ import annotations

import dataclasses
import math
import re

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_ARRAY = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class HloFlops:
    """Per-device matmul FLOPs of a program and the loops whose trip count was not found."""

    flops: float
    unknown_loops: tuple[str, ...]


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str


def _split_top(text: str) -> tuple[str, str]:
    """(the balanced parenthesized prefix of ``text`` without its parens, the rest)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return text[1:i], text[i + 1 :]
    return text[1:], ""


def _parse_instr(line: str) -> _Instr | None:
    match = _INSTR.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    if rest.startswith("("):
        shape, rest = _split_top(rest)
        rest = rest.lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op_match = re.match(r"([\w\-]+)\(", rest)
    if op_match is None:
        return None
    args, attrs = _split_top(rest[op_match.end() - 1 :])
    operands = [a.strip().split()[-1].lstrip("%") for a in _top_commas(args) if a.strip()]
    return _Instr(name=name, shape=shape, op=op_match.group(1), operands=operands, attrs=attrs)


def _top_commas(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _dims(shape: str) -> list[int] | None:
    match = _ARRAY.match(shape)
    if match is None:
        return None
    return [int(d) for d in match.group(1).split(",") if d]


def _attr(attrs: str, key: str) -> str | None:
    match = re.search(rf"\b{key}=(\{{[^}}]*\}}|[^,\s]+)", attrs)
    return None if match is None else match.group(1)


def _dot_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    out, lhs = _dims(instr.shape), _dims(shapes.get(instr.operands[0], ""))
    contracting = _attr(instr.attrs, "lhs_contracting_dims")
    if out is None or lhs is None or contracting is None:
        return 0.0
    dims = [int(d) for d in contracting.strip("{}").split(",") if d]
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims)


def _window(attrs: str) -> list[dict[str, int]]:
    """The per-spatial-dimension window of a convolution's ``window={...}``."""
    text = _attr(attrs, "window") or "{}"
    fields = dict(f.split("=", 1) for f in text.strip("{}").split() if "=" in f)
    if "size" not in fields:
        return []
    n = len(fields["size"].split("x"))
    dims: list[dict[str, int]] = [{} for _ in range(n)]
    for key, default in (("stride", 1), ("lhs_dilate", 1), ("rhs_dilate", 1)):
        values = fields.get(key, "x".join(["1"] * n)).split("x")
        for d, v in zip(dims, values, strict=True):
            d[key] = int(v) if v else default
    for d, pad in zip(dims, fields.get("pad", "x".join(["0_0"] * n)).split("x"), strict=True):
        low, high = pad.split("_")
        d["low"], d["high"] = int(low), int(high)
    return dims


def _conv_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    out = _dims(instr.shape)
    lhs = _dims(shapes.get(instr.operands[0], ""))
    rhs = _dims(shapes.get(instr.operands[1], ""))
    labels = _attr(instr.attrs, "dim_labels")
    if out is None or lhs is None or rhs is None or labels is None:
        return 0.0
    lhs_l, rest = labels.split("_", 1)
    rhs_l, out_l = rest.split("->")
    spatial = sorted(c for c in lhs_l if c.isdigit())
    window = _window(instr.attrs)
    valid = 1
    for i, s in enumerate(spatial):
        n_in, n_k, n_out = lhs[lhs_l.index(s)], rhs[rhs_l.index(s)], out[out_l.index(s)]
        w = window[i] if i < len(window) else {"stride": 1, "lhs_dilate": 1, "rhs_dilate": 1}
        w = {"low": 0, "high": 0, **w}
        count = 0
        for k in range(n_k):
            for o in range(n_out):
                undilated = o * w["stride"] - w["low"] + k * w["rhs_dilate"]
                if undilated % w["lhs_dilate"]:
                    continue
                if 0 <= undilated // w["lhs_dilate"] < n_in:
                    count += 1
        valid *= count
    features = int(_attr(instr.attrs, "feature_group_count") or 1)
    batches = int(_attr(instr.attrs, "batch_group_count") or 1)
    fma = (
        lhs[lhs_l.index("f")]
        // features
        * out[out_l.index("f")]
        * lhs[lhs_l.index("b")]
        // batches
        * valid
    )
    return 2.0 * fma


def _trip_count(loop: _Instr, comps: dict[str, list[_Instr]]) -> int | None:
    """N of a ``while``: XLA's ``known_trip_count`` when it records one (XLA:CPU does), else the
    bound of its condition's ``compare(i, constant(N)), direction=LT`` (or GT, swapped), looking
    through a fusion that wraps the compare."""
    known = _KNOWN_TRIPS.search(loop.attrs)
    if known:
        return int(known.group(1))
    condition = comps.get((_attr(loop.attrs, "condition") or "").lstrip("%"), [])
    constants = {
        i.name: int(i.operands[0])
        for i in condition
        if i.op == "constant" and i.operands and re.fullmatch(r"-?\d+", i.operands[0])
    }
    for instr in reversed(condition):
        compare, args = instr, instr.operands
        if instr.op == "fusion":
            fused = comps.get((_attr(instr.attrs, "calls") or "").lstrip("%"), [])
            params = {i.name: int(i.operands[0]) for i in fused if i.op == "parameter"}
            compare = next((i for i in reversed(fused) if i.op == "compare"), None)
            if compare is None or not all(a in params for a in compare.operands):
                continue
            args = [instr.operands[params[a]] for a in compare.operands]
        if compare.op != "compare" or len(args) != 2:
            continue
        direction = _attr(compare.attrs, "direction")
        if direction == "LT" and args[1] in constants:
            return constants[args[1]]
        if direction == "GT" and args[0] in constants:
            return constants[args[0]]
    return None


def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """({computation name: its instructions}, the entry computation's name)."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            instr = _parse_instr(line)
            if instr is not None:
                comps[current].append(instr)
    return comps, entry


def matmul_flops(hlo_text: str) -> HloFlops:
    """Per-device matmul FLOPs of an optimized HLO module's text (``Compiled.as_text()``)."""
    comps, entry = parse_module(hlo_text)
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    memo: dict[str, float] = {}
    unknown: list[str] = []

    def flops_of(name: str) -> float:
        if name in memo:
            return memo[name]
        memo[name] = 0.0  # guards against a malformed cyclic call graph
        total = 0.0
        for instr in comps.get(name, []):
            if instr.op == "dot":
                total += _dot_flops(instr, shapes)
            elif instr.op == "convolution":
                total += _conv_flops(instr, shapes)
            elif instr.op == "custom-call":
                cost = _COST.search(instr.attrs)
                total += float(cost.group(1)) if cost else 0.0
            if instr.op == "while":
                body = _attr(instr.attrs, "body")
                trips = _trip_count(instr, comps)
                if trips is None:
                    unknown.append(instr.name)
                total += (trips or 1) * flops_of((body or "").lstrip("%"))
                continue
            branches = _BRANCHES.search(instr.attrs)
            if branches:
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                total += max((flops_of(b) for b in names), default=0.0)
                continue
            called = [n for k, n in _CALLED.findall(instr.attrs) if k != "body"]
            if instr.op == "conditional":
                total += max((flops_of(n) for n in called), default=0.0)
            else:
                total += sum(flops_of(n) for n in called)
        memo[name] = total
        return total

    return HloFlops(flops=flops_of(entry), unknown_loops=tuple(unknown))
