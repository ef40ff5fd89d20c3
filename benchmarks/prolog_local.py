"""What the prolog's fast path adds to a job start, measured on this machine (no cluster).

A temporary node: config, fake GPUs, kernel log, a fresh stored verdict and tier 0's spool,
all under a temp directory; the prolog is the shipped shell hook library run as the shipped
`prolog/gpuwarden-prolog` runs it, with this interpreter as GPUWARDEN_PYTHON. Baseline, in the
same run: `python3 -I -c pass` with the same interpreter. Prints median and p95 of each.

The hooks' rule on what root imports (prolog/gpuwarden_pystart.py) is measured apart: the
wrapper's check before Python starts (gw_check_python, a find and a readlink per link), and the
prolog started as the hooks start it now (`-I -S gpuwarden_pystart.py`: the site directories,
.pth files and every imported module checked) against the way it was started before the rule
(`-I -c "from gpuwarden.hooks.run import main ..."`, site.py unchecked).

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


OLD_BOOT = ("import sys\nfrom gpuwarden.hooks.run import main\n"
            "sys.exit(main(sys.argv[1:]))")


def _line(name: str, xs: list[float]) -> str:
    return (f"  {name:<44} median {statistics.median(xs) * 1e3:6.1f} ms  "
            f"p95 {pct(xs, 0.95) * 1e3:6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        environ = make_node(root)
        lib = f"{REPO}/prolog/gpuwarden-hook.sh"
        start = f"{REPO}/prolog/gpuwarden_pystart.py"
        hook = ["/bin/sh", "-c", f'. {lib}; gw_hook prolog {root / "default"} /bin/true {start}']
        check = ["/bin/sh", "-c", f'. {lib}; gw_check_python {sys.executable}; '
                 '[ -z "$_gw_why" ] || { echo "$_gw_why" >&2; exit 1; }; printf %s "$_gw_stdlib"']
        times(hook, environ, 1)  # the first prolog takes the full path and leaves the settings
        if not (root / "run" / SETTINGS).exists():
            raise SystemExit("the full prolog left no fast-path settings")
        stdlib = subprocess.run(check, env={}, capture_output=True, text=True, check=True).stdout
        runs: dict[str, tuple[list[str], list[float]]] = {
            "python3 -I -c pass": ([sys.executable, "-I", "-c", "pass"], []),
            "wrapper's check (gw_check_python)": (check, []),
            "prolog, Python as started before the rule": (
                [sys.executable, "-I", "-c", OLD_BOOT, "prolog"], []),
            "prolog, Python as started now (pystart)": (
                [sys.executable, "-I", "-S", start, "prolog", stdlib], []),
            "gpuwarden prolog (fast path), whole hook": (hook, []),
        }
        for _ in range(args.runs):  # interleaved: all see the same machine load
            for argv, xs in runs.values():
                xs.extend(times(argv, environ, 1))
    print(f"{args.runs} runs each, interpreter {sys.executable}")
    for name, (_, xs) in runs.items():
        print(_line(name, xs))
    base, gate = runs["python3 -I -c pass"][1], runs["gpuwarden prolog (fast path), whole hook"][1]
    print(f"  added per job start: {(statistics.median(gate) - statistics.median(base)) * 1e3:.1f} "
          f"ms at the median, {(pct(gate, 0.95) - pct(base, 0.95)) * 1e3:.1f} ms at p95")
    med = {name: statistics.median(xs) for name, (_, xs) in runs.items()}
    rule = (med["wrapper's check (gw_check_python)"] + med["prolog, Python as started now (pystart)"]
            - med["prolog, Python as started before the rule"])
    print(f"  of which the rule on what root imports: {rule * 1e3:.1f} ms at the median (the "
          "wrapper's check, plus pystart's start over the old one)")


if __name__ == "__main__":
    main()
