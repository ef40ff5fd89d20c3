"""The job_submit filter's cost per submit, in Lua 5.1 (what slurmctld runs), at fleet scale.

A 10,000-node snapshot with 625 leaf switches of 16 nodes (1% of nodes suspect, so the
exclusion list is long), a 32-node gang job per call. Baseline in the same run: a filter that
only returns slurm.SUCCESS, so the ratio shows what the decision adds. Goal: under 200 us a call.

    .venv/bin/python benchmarks/placement_lua.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuwarden.config.placement import PlacementConfig
from gpuwarden.placement import snapshot
from gpuwarden.slurm import topology
from gpuwarden.slurm.models import Node

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "benchmarks" / "lua" / "bench_filter.lua"
FILTER = ROOT / "plugins" / "job_submit.lua"
NODES, PER_LEAF = 10_000, 16


def big_snapshot() -> str:
    names = [f"n{i:05d}" for i in range(NODES)]
    topo_text = "\n".join(
        f"SwitchName=leaf{k} Nodes=n[{k * PER_LEAF:05d}-{(k + 1) * PER_LEAF - 1:05d}]"
        for k in range(NODES // PER_LEAF))
    topo = topology.parse(topo_text)
    nodes = [Node(n, ("IDLE",), "", "", None, ("gpu",), "gpu:h100:8", (), None,
                  "gpuwarden: would drain: ecc" if i % 100 == 7 else "")
             for i, n in enumerate(names)]
    snap = snapshot.build(PlacementConfig(), topo, nodes, {"gpu": tuple(names)}, (), 1,
                          time.time())
    return snapshot.render(snap)


def run(lua: str, filter_file: Path, snap_file: Path, calls: int) -> tuple[float, float]:
    # The driver on stdin: the filter is then the outermost file on the Lua stack, as when
    # slurmctld loads it, and looks for its snapshot in its own directory.
    out = subprocess.run([lua, "-", str(filter_file), str(snap_file), str(calls), "32"],
                         stdin=DRIVER.open(), capture_output=True, text=True, check=True,
                         timeout=600).stdout.split()
    return float(out[0]), float(out[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20_000)
    args = ap.parse_args()
    lua = shutil.which("lua5.1")
    if lua is None:
        print("lua5.1 is not installed: apt-get install lua5.1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        # As slurmctld loads it: the filter reads its snapshot only from beside itself.
        snap_file = Path(tmp) / "gpuwarden-placement.lua"
        snap_file.write_text(big_snapshot())
        snap_file.chmod(0o644)
        ours_file = Path(tmp) / "job_submit.lua"
        shutil.copy(FILTER, ours_file)
        trivial = Path(tmp) / "trivial.lua"
        trivial.write_text("function slurm_job_submit(j, p, u) return slurm.SUCCESS end\n")
        size = snap_file.stat().st_size
        base, _ = run(lua, trivial, snap_file, args.calls)
        ours, reload_ms = run(lua, ours_file, snap_file, args.calls)
    print(f"snapshot: {NODES} nodes, {NODES // PER_LEAF} leaf switches, {size / 1024:.0f} KiB")
    print(f"baseline filter (returns SUCCESS): {base:8.2f} us/call")
    print(f"gpuwarden job_submit.lua:          {ours:8.2f} us/call ({ours / base:.1f}x the "
          f"baseline)")
    print(f"loading a new snapshot generation:  {reload_ms:8.2f} ms, once per change")
    ok = ours < 200
    print(f"goal < 200 us/call: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
