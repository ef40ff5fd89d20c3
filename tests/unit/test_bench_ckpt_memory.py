"""benchmarks/ckpt_memory.py runs and prints each of its five ratios (tiny state: the figures
themselves are for a quiet machine, `--mb 256`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.torchreq import torch

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_prints_every_ratio() -> None:
    assert torch.__version__
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ckpt_memory.py"), "--mb", "4",
                          "--repeat", "1"], capture_output=True, text=True, timeout=300,
                         check=False, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    for line in ("save stall / raw write", "restore speed / memory copy",
                 "torch save / numpy save", "DCP via gpuwarden / FileSystemWriter",
                 "the same, 2 ranks over gloo"):
        assert line in res.stdout, res.stdout
