"""gpuwarden.slurm.jobenv: the one reader of the Slurm job environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwarden.slurm import jobenv

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("raw", "ok"), [
    ("1234", True), ("123456789012", True), ("1234567890123", False), ("", False),
    ("12_3", False), ("-1", False), ("\u0661", False), ("\u00b2", False), ("12\n", False),
])
def test_digits_are_plain_ascii_and_bounded(raw: str, ok: bool) -> None:
    assert jobenv.digits(raw, jobenv.JOB_ID_DIGITS) is ok
    assert jobenv.valid_job_id({jobenv.JOB_ID: raw}) == (raw if ok else "")


def test_raw_readers_tell_unset_where_a_caller_needs_it() -> None:
    assert jobenv.job_id({}) == "" and jobenv.job_id({}, "?") == "?"
    assert jobenv.job_gid({}) is None and jobenv.job_gid({jobenv.JOB_GID: ""}) == ""
    assert jobenv.procid({}) is None and jobenv.ntasks({}) is None
    assert jobenv.restart_count({}) is None
    assert jobenv.job_restart_count({}) == jobenv.job_restart_count(
        {jobenv.JOB_RESTART_COUNT: ""}) == "0"
    assert jobenv.job_exit_codes({"SLURM_JOB_DERIVED_EC": "1"}) == ("", "", "1")


def test_node_name_is_slurmd_s_else_the_short_host_name() -> None:
    assert jobenv.node_name({jobenv.NODENAME: "c7"}, lambda: "x.example") == "c7"
    assert jobenv.node_name({jobenv.NODENAME: ""}, lambda: "c9.example.org") == "c9"
    assert jobenv.node_name({}) == jobenv.node_name({}, lambda: os.uname().nodename)


def test_it_is_cheap_enough_for_the_prologs_fast_path() -> None:
    out = subprocess.run([sys.executable, "-I", "-S", "-c",
                          "import sys; sys.path.insert(0, sys.argv[1]); "
                          "import gpuwarden.slurm.jobenv; print(' '.join(sys.modules))",
                          str(REPO)],
                         capture_output=True, text=True, check=True, timeout=30)
    loaded = set(out.stdout.split())
    for heavy in ("typing", "collections", "re", "socket", "logging", "enum", "functools"):
        assert heavy not in loaded, f"jobenv imports {heavy}"
