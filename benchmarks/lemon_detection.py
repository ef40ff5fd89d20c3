"""Lemon detection quality on simulated 30-day fleets: recall and precision against the truth.

Each case is one calibrated fleet (the same per-node rates as `gpuwarden simulate`, with the
given share of lemons) scanned by the detector exactly as `gpuwarden lemon scan --from` would.
Goal: recall >= 0.95 and precision >= 0.9 in every case.

    .venv/bin/python benchmarks/lemon_detection.py [--nodes 2000] [--days 30] [--seeds 3]

`--lemon-rate-scale 0.05` makes lemons 20x less bad than the paper's figures imply, to see where
detection stops working.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from gpuwarden.fleet.calibrate import solve
from gpuwarden.fleet.simulate import Fleet, write_history
from gpuwarden.lemon.history import from_files, read_events
from gpuwarden.lemon.scoring import score

FRACTIONS = (0.005, 0.012, 0.02, 0.03)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lemon-rate-scale", type=float, default=1.0,
                    help="make lemons this much less bad than the calibration (a harder test)")
    args = ap.parse_args()
    base = solve()
    base = replace(base, lemon_rate=base.lemon_rate * args.lemon_rate_scale)
    print(f"lemons fail {base.lemon_rate / (base.normal_rate + base.transient_rate):.0f}x as "
          "often as ordinary nodes")
    worst_r = worst_p = 1.0
    print(f"{'LEMONS':>7} {'SEED':>4} {'TRUE':>5} {'FLAGGED':>7} {'RECALL':>6} {'PRECISION':>9}"
          f" {'SCAN S':>6}")
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-") as tmp:
        for frac in FRACTIONS:
            params = replace(base, lemon_fraction=frac)
            for seed in range(args.seeds):
                out = Path(tmp) / f"{frac}-{seed}"
                w = write_history(params, Fleet(nodes=args.nodes, days=args.days, seed=seed), out)
                t0 = time.perf_counter()
                hist = from_files([str(f) for f in w.files], read_events(str(w.events)))
                flagged = {s.node for s in score(hist.attribution) if s.lemon}
                secs = time.perf_counter() - t0
                truth = set(w.lemons)
                tp = len(flagged & truth)
                recall = tp / len(truth) if truth else 1.0
                precision = tp / len(flagged) if flagged else 1.0
                worst_r, worst_p = min(worst_r, recall), min(worst_p, precision)
                print(f"{100 * frac:>6.1f}% {seed:>4} {len(truth):>5} {len(flagged):>7} "
                      f"{recall:>6.2f} {precision:>9.2f} {secs:>6.1f}", flush=True)
    ok = worst_r >= 0.95 and worst_p >= 0.9
    print(f"worst recall {worst_r:.2f} (goal >= 0.95), worst precision {worst_p:.2f} "
          f"(goal >= 0.9): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
