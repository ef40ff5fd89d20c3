"""What the prolog's fast path adds to a job start, measured on this machine (no cluster).

A temporary node: config, fake GPUs, kernel log, a fresh stored verdict and tier 0's spool,
all under a temp directory; the prolog is the shipped shell hook library run as the shipped
`prolog/gpuwarden-prolog` runs it, with this interpreter as GPUWARDEN_PYTHON. Baseline, in the
same run: `python3 -I -c pass` with the same interpreter. Prints median and p95 of both.

    .venv/bin/python benchmarks/prolog_local.py [--runs 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuwarden import config as configmod
from gpuwarden.health.fastgate import SETTINGS, fingerprint
from gpuwarden.health.gather import gather
from gpuwarden.health.probe import healthy_fake
from gpuwarden.health.store import Store

REPO = Path(__file__).resolve().parents[1]


def make_node(root: Path) -> dict[str, str]:
    (root / "kmsg").write_text("")
    (root / "gpus.json").write_text(healthy_fake(8))
    (root / "shm").mkdir()
    (root / "shm").chmod(0o1777)
    (root / "fsx").mkdir()
    (root / "gpuwarden.toml").write_text(f"""
[health]
gpu_probe = "fake"
fake_gpu_file = "{root / 'gpus.json'}"
kernel_log = "{root / 'kmsg'}"
state_dir = "{root / 'state'}"
prolog_budget_s = 1.0
epilog_budget_s = 1.0
periodic_budget_s = 1.0
[health.expected]
gpu_count = 8
mounts = [{{path = "/"}}]
[ckpt]
memory_root = "{root / 'shm'}"
""")
    (root / "default").write_text(f"GPUWARDEN_PYTHON={sys.executable}\n")
    (root / "default").chmod(0o600)
    environ = {"GPUWARDEN_CONFIG": str(root / "gpuwarden.toml"),
               "GPUWARDEN_RUN_DIR": str(root / "run"), "SLURMD_NODENAME": "c1",
               "SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
               "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid())}
    cfg = configmod.load(environ["GPUWARDEN_CONFIG"])
    # The fake GPU file must predate the verdict by more than a budget (else it is "new").
    time.sleep(1.1)
    verdict = gather(cfg.health, "c1", "health check", 10.0)
    # As the full checks save it: with the fake GPU file's fingerprint, else the fast path
    # (rightly) sees the file as changed and every prolog takes the full path.
    Store(cfg.health.state_dir).save_verdict(verdict, fake_fp=fingerprint(str(root / "gpus.json")))
    return environ


def times(argv: list[str], environ: dict[str, str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        res = subprocess.run(argv, env=environ, capture_output=True, check=False)
        out.append(time.perf_counter() - t)
        if res.returncode:
            raise SystemExit(f"{argv[0]} exited {res.returncode}: {res.stderr.decode()[-500:]}")
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        environ = make_node(root)
        hook = ["/bin/sh", "-c", f'. {REPO}/prolog/gpuwarden-hook.sh; '
                f'gw_hook prolog {root / "default"} /bin/true']
        times(hook, environ, 1)  # the first prolog takes the full path and leaves the settings
        if not (root / "run" / SETTINGS).exists():
            raise SystemExit("the full prolog left no fast-path settings")
        base, gate = [], []
        for _ in range(args.runs):  # interleaved: both see the same machine load
            base += times([sys.executable, "-I", "-c", "pass"], environ, 1)
            gate += times(hook, environ, 1)
    print(f"{args.runs} runs each, interpreter {sys.executable}")
    for name, xs in (("python3 -I -c pass", base), ("gpuwarden prolog (fast path)", gate)):
        print(f"  {name:<30} median {statistics.median(xs) * 1e3:6.1f} ms  "
              f"p95 {pct(xs, 0.95) * 1e3:6.1f} ms")
    print(f"  added per job start: {(statistics.median(gate) - statistics.median(base)) * 1e3:.1f} "
          f"ms at the median, {(pct(gate, 0.95) - pct(base, 0.95)) * 1e3:.1f} ms at p95")


if __name__ == "__main__":
    main()
