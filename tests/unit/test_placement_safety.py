"""Issue 11, item 6: the submit filter runs inside slurmctld and must not be able to hurt it.

A hostile snapshot cannot grow the filter's memory; a snapshot (or directory) someone other than
root or slurmctld's user could write is refused; a decision never leaves a runnable job
unrunnable. Driven under lua5.1 as slurmctld loads the filter (beside its snapshot)."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.config.placement import PartitionPolicy
from gpuwarden.core import safefs
from gpuwarden.placement import daemon, snapshot
from gpuwarden.placement.cli import _snapshot_age
from gpuwarden.placement.decide import JobRequest, count_names, decide
from tests.conftest import in_ci
from tests.unit.test_placement import (
    DRIVER,
    cases_lua,
    daemon_setup,
    filter_dir,
    lua,
    node,
    run_filter,
    snap,
)

HEADER = "-- gpuwarden placement snapshot generation 9 written 2000000000\n"
LIMIT = 512 << 20  # address space for the lua5.1 process: a runaway filter stops here


def filter_peak(tmp: Path, text: str) -> tuple[list[str], int]:
    """The filter's log lines for one 4-node GPU job, and the lua5.1 process's peak RSS (KiB)."""
    d = filter_dir(tmp)
    (d / "gpuwarden-placement.lua").write_text(text)
    (d / "gpuwarden-placement.lua").chmod(0o644)
    cases = tmp / "cases.lua"
    cases.write_text(cases_lua([JobRequest(4, True)]))
    # On stdin, as run_filter does: job_submit.lua is the outermost file, as in slurmctld.
    wrapper = (
        f'arg = {{ "{d / "job_submit.lua"}", "{d / "gpuwarden-placement.lua"}", "{cases}" }}\n'
        + DRIVER.read_text() + '\n'
        'local s = io.open("/proc/self/status"):read("*a")\n'
        'print("peak " .. string.match(s, "VmHWM:%s*(%d+)"))\n')

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    out = subprocess.run([lua(), "-"], input=wrapper, capture_output=True, text=True,
                         timeout=60, check=True, preexec_fn=cap).stdout.splitlines()
    assert out[0] == "case 1 rc=0" and out[-1].startswith("peak "), out
    return [x for x in out[1:-1]], int(out[-1].split()[1])


def _concat(operands: int) -> str:
    return "local s = 'xxxxxxxxxxxxxxxx'\nwhile true do s = " + "..".join(["s"] * operands) \
        + " end\n"


HOSTILE = {
    # The reproduction: a few bytes doubling a string, about 1 GB in 5 s before.
    "doubling": HEADER + "local s = 'x'\nwhile true do s = s .. s end\nreturn {}\n",
    # One instruction growing a string 190-fold: defeats any per-N-instructions memory hook.
    "wide concat": HEADER + _concat(190),
    # Valid records up to the byte cap: capacity lists and exclusion groups hit the item cap.
    "huge capacity": HEADER + "-- x\nformat 4\npartition p mode=off wait=0 min_nodes=2 "
    "shadow=0 size=1 in_service=1 healthy=1 gpus=8:1 capacity="
    + ",".join(["1"] * 2_000_000) + "\nend\n",
    "huge gpus": HEADER + "-- x\nformat 4\npartition p mode=off wait=0 min_nodes=2 "
    "shadow=0 size=1 in_service=1 healthy=1 gpus=" + ",".join(["8:1"] * 1_000_000)
    + " capacity=1\nend\n",
    "many groups": HEADER + "-- x\nformat 4\npartition p mode=off wait=0 min_nodes=2 shadow=0 "
    "size=1 in_service=1 healthy=1 gpus=8:1 capacity=1\n"
    + "avoid p keep=1 nodes=n1\n" * 170_000 + "end\n",
    "long line": HEADER + "-- x\nformat 4\npartition " + "p" * (4 << 20) + "\nend\n",
    "huge fit": HEADER + "-- x\nformat 4\npartition p mode=off wait=0 min_nodes=2 shadow=0 "
    "size=1 in_service=1 healthy=1 gpus=8:1 capacity=1\nfit p "
    + " ".join(f"{n}:0" for n in range(1, 400_000)) + "\nend\n",
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_snapshot_leaves_the_filters_memory_bounded(tmp_path: Path, kind: str) -> None:
    logs, peak_kib = filter_peak(tmp_path, HOSTILE[kind])
    assert peak_kib < 48 * 1024, f"{kind}: the filter's process peaked at {peak_kib} KiB"
    # ...and the job went through unchanged, with one line saying why.
    assert len(logs) == 1 and logs[0].startswith("log info: gpuwarden placement: snapshot ")
    assert logs[0].endswith("job from uid 1000 unchanged"), logs


def test_a_real_snapshot_still_loads_within_the_bound(tmp_path: Path) -> None:
    logs, peak_kib = filter_peak(tmp_path, snapshot.render(snap(lemons=("c6",))))
    assert peak_kib < 16 * 1024
    assert any("exclude c6" in x for x in logs), logs


# ---- who may write the snapshot --------------------------------------------------------------
def need_lfs() -> None:
    probe = subprocess.run([lua(), "-e", 'require "lfs"'], capture_output=True, timeout=10)
    if probe.returncode != 0:
        if in_ci():
            pytest.fail("lua-filesystem for Lua 5.1 is missing: the owner checks are untested")
        pytest.skip("lua-filesystem for Lua 5.1 is not installed (apt-get install lua-filesystem)")


def _others_can_write_file(f: Path, d: Path) -> None:
    f.chmod(0o666)


def _group_can_write_dir(f: Path, d: Path) -> None:
    d.chmod(0o775)


def _someone_else_owns_it(f: Path, d: Path) -> None:
    os.chown(f, 4242, 4242)


def _a_link(f: Path, d: Path) -> None:
    real = d.parent / "elsewhere.lua"
    f.rename(real)
    f.symlink_to(real)


def _a_fifo(f: Path, d: Path) -> None:
    f.unlink()
    os.mkfifo(f)  # opening it would block slurmctld under its locks, for good


@pytest.mark.parametrize("unsafe,needle", [
    (_others_can_write_file, "the file is writable by group or others (rw-rw-rw-)"),
    (_group_can_write_dir, "its directory is writable by group or others (rwxrwxr-x)"),
    (_someone_else_owns_it, "the file is owned by uid 4242, not by root or slurmctld's user"),
    (_a_link, "the file is a link, not a file"),
    (_a_fifo, "the file is a named pipe, not a file"),
])
def test_a_snapshot_others_could_write_is_refused(tmp_path: Path, unsafe, needle) -> None:  # type: ignore[no-untyped-def]
    need_lfs()
    if os.geteuid() != 0 and unsafe is _someone_else_owns_it:
        pytest.skip("chown needs root")
    d = filter_dir(tmp_path)
    f = d / "gpuwarden-placement.lua"
    f.write_text(snapshot.render(snap(lemons=("c6",))))
    f.chmod(0o644)
    unsafe(f, d)
    [got] = run_filter(tmp_path, None, [JobRequest(4, True)], timeout=10)
    assert set(got) == {"rc", "logs"} and got["rc"] == "0"
    assert got["logs"] == [f"info: gpuwarden placement: snapshot {f} {needle}; job from uid "
                           "1000 unchanged"]


def test_a_safe_snapshot_is_used_with_the_owner_check_on(tmp_path: Path) -> None:
    need_lfs()
    [got] = run_filter(tmp_path, snapshot.render(snap(lemons=("c6",))), [JobRequest(4, True)])
    assert got["exc_nodes"] == "c6"


def test_a_snapshot_not_beside_job_submit_lua_is_refused(tmp_path: Path) -> None:
    """Its directory must be the one slurmctld already trusts for the code it runs, also when
    lua-filesystem is missing and nothing else can be checked in Lua."""
    elsewhere = tmp_path / "snapshot.lua"
    for lfs in (True, False):
        [got] = run_filter(tmp_path, snapshot.render(snap()), [JobRequest(4, True)], lfs=lfs,
                           snap_file=elsewhere)
        assert set(got) == {"rc", "logs"}
        assert "is not beside job_submit.lua" in got["logs"][0]  # type: ignore[index]


def test_without_lua_filesystem_the_filter_says_what_it_cannot_check(tmp_path: Path) -> None:
    [got] = run_filter(tmp_path, snapshot.render(snap(lemons=("c6",))), [JobRequest(4, True)],
                       lfs=False)
    assert got["exc_nodes"] == "c6"
    assert "lua-filesystem is not installed, so the owner and mode" in got["logs"][0]  # type: ignore[index]


def test_the_daemon_refuses_a_directory_others_can_write(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    cfg, slurm, lemons = daemon_setup(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cfg = replace(cfg, snapshot_file=str(shared / "snap.lua"))
    assert daemon.step(cfg, slurm, lemons, daemon.State(), 1000.0) is None  # type: ignore[arg-type]
    assert not (shared / "snap.lua").exists()
    assert "is writable by group or others" in caplog.text
    assert "refusing to write the placement snapshot there" in caplog.text


def test_the_daemon_replaces_a_snapshot_someone_else_loosened(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    cfg, slurm, lemons = daemon_setup(tmp_path)
    Path(cfg.snapshot_file).write_text("forged\n")
    Path(cfg.snapshot_file).chmod(0o666)
    with caplog.at_level(logging.ERROR):
        assert daemon.step(cfg, slurm, lemons, daemon.State(), 1000.0) is not None  # type: ignore[arg-type]
    st = os.lstat(cfg.snapshot_file)
    assert st.st_mode & 0o777 == 0o644 and st.st_uid == os.geteuid()
    assert "is writable by group or others (mode 666): replacing it" in caplog.text


def test_explain_reports_a_snapshot_the_filter_refuses(tmp_path: Path) -> None:
    f = tmp_path / "snap.lua"
    os.mkfifo(f)  # explain must not hang on it either
    assert "the filter refuses its snapshot" in _snapshot_age(str(f), 120)
    assert "not a regular file" in safefs.admin_file_problem(str(f))


# ---- never make a runnable job unrunnable ----------------------------------------------------
def test_a_reservation_job_is_left_to_its_reservation() -> None:
    # An exact-size reservation holding a suspect: excluding it would leave the job pending.
    d = decide(snap(lemons=("c6",)), JobRequest(4, True, reservation="r4"))
    assert (d.action, d.exc_nodes, d.switches, d.why) == ("pass", None, None, "--reservation kept")


def test_the_users_own_exclusions_count_before_ours_are_added() -> None:
    # 8 nodes, c6 a lemon, the user excludes two: 6 remain for a 6-node job only without ours.
    d = decide(snap(lemons=("c6",)), JobRequest(6, True, exc_nodes="c[1-2]"))
    assert d.exc_nodes is None and "not excluded c6: too few nodes like them" in d.why
    assert decide(snap(lemons=("c6",)), JobRequest(5, True, exc_nodes="c[1-2]")).exc_nodes \
        == "c[1-2],c6"


def test_a_suspect_of_a_scarce_node_kind_is_kept_for_jobs_that_need_that_kind() -> None:
    # c5-c8 are the only a100 nodes: a 4-node a100 job needs all four, c6 included.
    nodes = [node(f"c{i}") for i in range(1, 5)] + [
        replace(node(f"c{i}"), gres="gpu:a100:8") for i in range(5, 9)]
    s = snap(nodes, lemons=("c2", "c6"))
    assert s.partitions["gpu"].avoid == ((3, ("c2",)), (3, ("c6",)))
    assert decide(s, JobRequest(4, True)).exc_nodes is None
    assert decide(s, JobRequest(3, True)).exc_nodes == "c2,c6"


def test_a_drained_node_still_counts_as_one_the_job_can_wait_for() -> None:
    # exc_nodes lasts the job's life; the drained c1 comes back, the excluded c6 never would.
    nodes = [node(f"c{i}") for i in range(1, 9)]
    nodes[0] = node("c1", ("IDLE", "DRAIN"), "gpuwarden: xid 79")
    assert snap(nodes, lemons=("c6",)).partitions["gpu"].avoid == ((7, ("c6",)),)


def test_jobs_in_several_partitions_get_no_exclusions() -> None:
    d = decide(snap(lemons=("c6",)), JobRequest(2, True, partition="gpu,cpu"))
    assert d.exc_nodes is None and "several partitions" in d.why


@pytest.mark.parametrize("expr,count", [
    ("", 0), ("c1", 1), ("c[1-4,7],d5", 6), ("c[01-10]-ib", 10), ("c[1-2]-[3-4]", 4),
    ("c[1-", None), ("c]", None), ("c1,,c2", 2), ("c[4-1]", None), ("c[x]", None),
])
def test_hostlist_counts_agree_between_python_and_lua(tmp_path: Path, expr: str,
                                                     count: int | None) -> None:
    assert count_names(expr) == count
    d = filter_dir(tmp_path)
    script = (f'gpuwarden_snapshot_path = "{d}/none"\nslurm = {{ SUCCESS = 0 }}\n'
              f'dofile("{d / "job_submit.lua"}")\n'
              f'print(tostring(gpuwarden_placement.count_names("{expr}")))\n')
    out = subprocess.run([lua(), "-"], input=script, capture_output=True, text=True, timeout=10,
                         check=True).stdout.strip()
    assert out == ("nil" if count is None else str(count))


def test_a_policy_change_alone_does_not_exclude_more_than_is_safe() -> None:
    s = snap(lemons=("c6",), policy=PartitionPolicy(exclude_lemons=False))
    assert s.partitions["gpu"].avoid == () and decide(s, JobRequest(2, True)).exc_nodes is None
