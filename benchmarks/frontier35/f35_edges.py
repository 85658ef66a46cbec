"""Prints the (lag, lr, methods) blocks that find each method's edge: a lower rate where the
lowest run rate is unstable, then a higher one where the highest run rate is stable."""
import pathlib, sys
sys.path.insert(0, "benchmarks")
import frontier
LOWER = {128: [1e-3, 5e-4, 2.5e-4], 1: [2e-3, 1.5e-3, 1e-3]}
UPPER = {128: [1e-3, 1.5e-3, 2e-3], 1: [2e-3, 2.5e-3]}
table = frontier.cell_table(frontier.load_runs(pathlib.Path("runs/f35")))
methods = [m for m in frontier.METHODS if any(k[0] == m for k in table)]
want = {}
for mode, grid in (("lower", LOWER), ("upper", UPPER)):
    for lag, rates in grid.items():
        for m in methods:
            ran = {k[2]: g for k, g in table.items() if k[:2] == (m, lag) and k[3] == frontier.DEFAULT_SAT and g["seeds"] >= 3}
            if not ran:
                continue
            if mode == "lower":
                low = min(ran)
                if not ran[low]["stable"]:
                    nxt = [r for r in rates if r < low]
                    if nxt: want.setdefault((0, lag, max(nxt)), []).append(m)
            else:
                high = max(ran)
                if all(g["stable"] for g in ran.values()):
                    nxt = [r for r in rates if r > high]
                    if nxt: want.setdefault((1, lag, min(nxt)), []).append(m)
for (pri, lag, lr), ms in sorted(want.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
    print(lag, lr, " ".join(ms))
