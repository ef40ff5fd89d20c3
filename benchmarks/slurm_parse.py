"""How much gpuwarden's typed parsing adds on top of decoding Slurm's JSON, at fleet scale.

Baseline: json.loads of the same `scontrol show nodes --json` / `sacct --json` text, in the
same run. Prints the ratio (parse / baseline); the goal is at most 2x.

    .venv/bin/python benchmarks/slurm_parse.py [--nodes 10000] [--jobs 50000]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from gpuwarden.slurm import parse

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def best_of(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scaled(fixture: str, key: str, count: int, id_key: str) -> str:
    doc = json.loads((FIXTURES / fixture).read_text())
    items = doc[key]
    out = []
    for i in range(count):
        item = copy.deepcopy(items[i % len(items)])
        if id_key == "name":
            item["name"] = f"n{i}"
        else:
            item[id_key] = i + 1
        out.append(item)
    doc[key] = out
    return json.dumps(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    nodes_text = scaled("scontrol_show_nodes.json", "nodes", args.nodes, "name")
    base = best_of(lambda: json.loads(nodes_text), args.repeat)
    ours = best_of(lambda: parse.parse_nodes(nodes_text), args.repeat)
    print(f"scontrol show nodes --json, {args.nodes} nodes ({len(nodes_text) / 1e6:.1f} MB):")
    print(f"  json.loads {base * 1e3:8.1f} ms   parse_nodes {ours * 1e3:8.1f} ms   "
          f"ratio {ours / base:.2f} (goal <= 2.0)")

    sacct_text = scaled("sacct.json", "jobs", args.jobs, "job_id")
    base = best_of(lambda: json.loads(sacct_text), max(1, args.repeat // 2))
    ours = best_of(lambda: list(parse.iter_acct_jobs(sacct_text)), max(1, args.repeat // 2))
    print(f"sacct --json, {args.jobs} jobs ({len(sacct_text) / 1e6:.1f} MB):")
    print(f"  json.loads {base * 1e3:8.1f} ms   iter_acct_jobs {ours * 1e3:8.1f} ms   "
          f"ratio {ours / base:.2f} (goal <= 2.0)")


if __name__ == "__main__":
    main()
