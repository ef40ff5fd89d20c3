"""Issue 11 item 6, second review of the submit filter: "it must not be able to hurt slurmctld"
and "a decision must never make a runnable job unrunnable". Each test is one reproduced defect
(D1-D8 and the nits), run on the Python reference and on job_submit.lua under lua5.1."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.config.placement import PlacementConfig
from gpuwarden.placement import location, snapshot
from gpuwarden.placement.decide import MAX_FIELD, JobRequest, count_names, decide
from gpuwarden.slurm import topology
from tests.unit.test_placement import (
    DRIVER,
    FILTER,
    cases_lua,
    filter_dir,
    lua,
    lua_str,
    node,
    run_filter,
    snap,
)

FAR_FUTURE = 4_102_444_800  # 2100: a reservation that has not ended


def agree(tmp: Path, s: snapshot.Snapshot, jobs: list[JobRequest], reserved: int | None = 0,
          reservations: str = "{}") -> list[dict[str, object]]:
    """Run ``jobs`` through the Lua filter and check each against the Python reference."""
    results = run_filter(tmp, snapshot.render(s), jobs, reservations=reservations)
    for job, got in zip(jobs, results, strict=True):
        want = decide(s, job, reserved)
        assert got["rc"] == "0"
        if want.action == "pass":
            assert not {"exc_nodes", "req_switch", "admin_comment"} & set(got), (job, got)
            continue
        assert got.get("req_switch") == (str(want.switches) if want.switches else None), job
        assert got.get("exc_nodes") == want.exc_nodes, job
        assert got["admin_comment"] == f"gpuwarden placement (snapshot 7): {want.why}", job
    return results


# ---- D1: --exclude separated as Slurm separates hostlists ------------------------------------
@pytest.mark.parametrize("expr,count", [
    ("c1 c2", 2), ("c1\tc2", 2), ("c1\nc2", 2), ("c[1-2] c3", 3), ("c1, c2", 2), (" c1 ", 1),
    ("c1,", 1), ("c[1-2]\tc[3-4],c5", 5), ("c[1-2 ]", None), ("c[0-9999999999]", None),
])
def test_exclude_lists_are_counted_as_slurm_splits_them(tmp_path: Path, expr: str,
                                                        count: int | None) -> None:
    assert count_names(expr) == count
    d = filter_dir(tmp_path)
    script = (f'gpuwarden_snapshot_path = "{d}/none"\nslurm = {{ SUCCESS = 0 }}\n'
              f'dofile("{d / "job_submit.lua"}")\n'
              f"print(tostring(gpuwarden_placement.count_names({lua_str(expr)})))\n")
    out = subprocess.run([lua(), "-"], input=script, capture_output=True, text=True, timeout=10,
                         check=True).stdout.strip()
    assert out == ("nil" if count is None else str(count))


@pytest.mark.parametrize("exclude", ["c1 c2", "c1\tc2", "c1\nc2", "c1, c2"])
def test_a_space_separated_exclude_is_not_undercounted(tmp_path: Path, exclude: str) -> None:
    # 8 nodes, c6 a lemon, the user excludes two: a 6-node job needs c6.
    [got] = agree(tmp_path, snap(lemons=("c6",)), [JobRequest(6, True, exc_nodes=exclude)])
    assert "exc_nodes" not in got and "not excluded c6" in str(got["admin_comment"])


# ---- D2: the most nodes the job could need, not -N's minimum ---------------------------------
def test_an_elastic_job_gets_no_exclusion_it_could_need_and_no_switch_count(
        tmp_path: Path) -> None:
    # -N 2-8 on 8 nodes: Slurm may give it all 8, c6 included; no single leaf holds 8.
    [elastic, fixed] = agree(tmp_path, snap(lemons=("c6",)),
                             [JobRequest(2, True, max_nodes=8), JobRequest(4, True, max_nodes=4)])
    assert "exc_nodes" not in elastic and "req_switch" not in elastic
    d = decide(snap(lemons=("c6",)), JobRequest(2, True, max_nodes=8))
    assert d.action == "pass" and "-N min-max: switches left to Slurm" in d.why
    assert fixed["exc_nodes"] == "c6" and fixed["req_switch"] == "1"


def test_a_gpu_total_that_needs_every_node_excludes_none(tmp_path: Path) -> None:
    # -N 2 --gpus=64 --gpus-per-node=8 (no maximum given): 8 nodes, so c6 is needed.
    job = JobRequest(2, True, gpus_per_job=64, gpus_per_node=8)
    [got] = agree(tmp_path, snap(lemons=("c6",)), [job])
    assert "exc_nodes" not in got and "req_switch" not in got
    d = decide(snap(lemons=("c6",)), job)
    assert "asks for 8 nodes" in d.user_message
    # With 16 GPUs it needs 2 nodes: one leaf, c6 excluded.
    [small] = agree(tmp_path, snap(lemons=("c6",)),
                    [JobRequest(2, True, gpus_per_job=16, gpus_per_node=8)])
    assert small["exc_nodes"] == "c6" and small["req_switch"] == "1"


def test_a_task_count_without_a_maximum_counts_as_that_many_nodes(tmp_path: Path) -> None:
    [got] = agree(tmp_path, snap(lemons=("c6",)), [JobRequest(2, True, tasks=8)])
    assert "exc_nodes" not in got


# ---- D3: the snapshot beside slurm.conf's job_submit.lua, whoever dofile()d us ---------------
def layout(tmp: Path, wrapped: bool, snapshot_in: str = "etc") -> Path:
    etc, opt = tmp / "etc", tmp / "opt"
    etc.mkdir(mode=0o755)
    opt.mkdir(mode=0o755)
    if wrapped:  # a site's own job_submit.lua calling gpuwarden's, as docs/placement.md says
        shutil.copy(FILTER, opt / "job_submit.lua")
        (etc / "job_submit.lua").write_text(
            f'dofile("{opt / "job_submit.lua"}")\nlocal ours = slurm_job_submit\n'
            "function slurm_job_submit(job, parts, uid) return ours(job, parts, uid) end\n")
    else:
        shutil.copy(FILTER, etc / "job_submit.lua")
    f = (etc if snapshot_in == "etc" else opt) / "gpuwarden-placement.lua"
    f.write_text(snapshot.render(snap(lemons=("c6",))))
    f.chmod(0o644)
    return etc / "job_submit.lua"


def as_slurmctld_loads(tmp: Path, conf_filter: Path) -> str:
    """Load slurm.conf's job_submit.lua the way slurmctld does (luaL_loadfile, then call it)
    and submit one 4-node GPU job; its exc_nodes and the log."""
    cases = tmp / "cases.lua"
    cases.write_text(cases_lua([JobRequest(4, True)]))
    driver = DRIVER.read_text().replace("gpuwarden_snapshot_path = snapshot\n", "") \
        .replace("dofile(filter)", "assert(loadfile(filter))()")
    out = subprocess.run([lua(), "-", str(conf_filter), "-", str(cases)], input=driver,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return out


@pytest.mark.parametrize("wrapped", [False, True], ids=["loaded directly", "dofile()d by a wrapper"])
def test_the_snapshot_is_found_beside_slurm_conf_in_both_layouts(tmp_path: Path,
                                                                  wrapped: bool) -> None:
    out = as_slurmctld_loads(tmp_path, layout(tmp_path, wrapped))
    assert "exc_nodes=c6" in out, out


def test_a_snapshot_beside_the_wrapped_code_is_not_used(tmp_path: Path) -> None:
    out = as_slurmctld_loads(tmp_path, layout(tmp_path, True, snapshot_in="opt"))
    assert "exc_nodes" not in out
    assert f"snapshot {tmp_path}/etc/gpuwarden-placement.lua missing" in out, out


# ---- D4: a huge user string is not parsed at all ---------------------------------------------
@pytest.mark.parametrize("field", ["exc_nodes", "partition"])
def test_an_overlong_user_string_leaves_the_job_alone_and_is_logged_once(
        tmp_path: Path, field: str) -> None:
    value = "c1," * (MAX_FIELD // 3 + 1)
    job = JobRequest(4, True, **{field: value})  # type: ignore[arg-type]
    d = decide(snap(lemons=("c6",)), job)
    assert d.action == "pass" and f"{field} is over {MAX_FIELD} bytes" in d.why
    results = run_filter(tmp_path, snapshot.render(snap(lemons=("c6",))), [job, job])
    assert all(set(r) == {"rc", "logs"} for r in results), results
    logs = [x for r in results for x in r["logs"]]  # type: ignore[attr-defined]
    assert logs == [f"info: gpuwarden placement: job from uid 1000: its {field} is over "
                    f"{MAX_FIELD} bytes: left alone unparsed (logged once per 300 s)"]


# ---- D5: admin_comment and the log line stay small -------------------------------------------
def many_suspects(n_nodes: int, n_suspects: int) -> snapshot.Snapshot:
    names = [f"n{i:05d}" for i in range(n_nodes)]
    topo = topology.parse(f"SwitchName=leaf1 Nodes=n[00000-{n_nodes - 1:05d}]\n")
    nodes = [node(x) for x in names]
    return snapshot.build(PlacementConfig(), topo, nodes, {"gpu": tuple(names)},
                          tuple(names[:n_suspects]), 7, time.time())


def test_thousands_of_suspects_give_a_bounded_admin_comment(tmp_path: Path) -> None:
    s = many_suspects(6000, 5000)
    [got] = agree(tmp_path, s, [JobRequest(4, True)])
    assert str(got["exc_nodes"]).count(",") == 4999  # the exclusion itself is whole
    comment = str(got["admin_comment"])
    assert len(comment) <= 1024, len(comment)
    assert "exclude 5000 nodes: n00000,n00001," in comment and "more)" in comment
    assert all(len(x) <= 1024 for x in got["logs"])  # type: ignore[attr-defined]


# ---- D6: spare nodes held by reservations do not count -------------------------------------
def test_nodes_held_by_a_reservation_do_not_count_as_spare(tmp_path: Path) -> None:
    # 8 nodes, c6 a lemon, c1-c2 reserved for others: a 6-node job needs c6.
    held = f'{{ r1 = {{ node_list = "c[1-2]", start_time = 0, end_time = {FAR_FUTURE} }} }}'
    [got] = agree(tmp_path, snap(lemons=("c6",)), [JobRequest(6, True)], reserved=2,
                  reservations=held)
    assert "exc_nodes" not in got and "not excluded c6" in str(got["admin_comment"])
    # A reservation that has ended holds nothing.
    ended = '{ r1 = { node_list = "c[1-2]", start_time = 0, end_time = 1 } }'
    [free] = agree(tmp_path, snap(lemons=("c6",)), [JobRequest(6, True)], reservations=ended)
    assert free["exc_nodes"] == "c6"


def test_without_reservations_to_look_at_nothing_is_excluded(tmp_path: Path) -> None:
    [got] = agree(tmp_path, snap(lemons=("c6",)), [JobRequest(4, True)], reserved=None,
                  reservations="nil")
    assert "exc_nodes" not in got
    assert "reservations not visible: suspects not excluded" in str(got["admin_comment"])


# ---- D7: no log line per job while the snapshot is missing -----------------------------------
def test_a_missing_snapshot_is_logged_once_and_never_for_non_gang_jobs(tmp_path: Path) -> None:
    jobs = [JobRequest(1, False), JobRequest(1, True), JobRequest(4, False)] + \
        [JobRequest(4, True)] * 3
    results = run_filter(tmp_path, None, jobs)
    logs: list[list[str]] = [r["logs"] for r in results]  # type: ignore[misc]
    assert logs[:3] == [[], [], []]
    assert len(logs[3]) == 1 and "missing" in logs[3][0]
    assert logs[4:] == [[], []]


# ---- D8: a snapshot that failed to parse is not parsed again ---------------------------------
def test_a_broken_generation_is_parsed_once(tmp_path: Path) -> None:
    text = snapshot.render(snap(lemons=("c6",))).replace("capacity=4,3", "capacity=x")
    d = filter_dir(tmp_path)
    f = d / "gpuwarden-placement.lua"
    f.write_text(text)
    f.chmod(0o644)
    cases = tmp_path / "cases.lua"
    cases.write_text(cases_lua([JobRequest(4, True)] * 4))
    # Count full reads: each one is a parse of up to 4 MiB under slurmctld's locks.
    count = ('local real_open, full = io.open, 0\n'
             'io.open = function(p, m) local f = real_open(p, m)\n'
             '  if f and p == arg[2] then return setmetatable({}, { __index = function(_, k)\n'
             '    if k == "read" then return function(_, n) if n ~= 256 then full = full + 1 end\n'
             '      return f:read(n) end end\n'
             '    return function(_, ...) return f[k](f, ...) end end }) end\n'
             '  return f end\n')
    script = count + DRIVER.read_text() + 'print("full reads " .. full)\n'
    out = subprocess.run([lua(), "-", str(d / "job_submit.lua"), str(f), str(cases)],
                         input=script, capture_output=True, text=True, timeout=30,
                         check=True).stdout
    assert "full reads 1\n" in out, out


# ---- nits ------------------------------------------------------------------------------------
def test_a_name_with_a_trailing_newline_is_refused_at_render() -> None:
    with pytest.raises(snapshot.SnapshotError, match="cannot be written"):
        snapshot._token("c1\n", "node")


def test_lfs_is_never_loaded_from_slurmctlds_working_directory(tmp_path: Path) -> None:
    cwd = tmp_path / "var-tmp"
    cwd.mkdir()
    planted = cwd / "planted-lfs-ran"
    (cwd / "lfs.lua").write_text(f'io.open("{planted}", "w"):close()\nreturn {{}}\n')
    [got] = run_filter(tmp_path, snapshot.render(snap(lemons=("c6",))), [JobRequest(4, True)],
                       cwd=cwd)
    assert got["rc"] == "0" and got["exc_nodes"] == "c6"
    assert not planted.exists(), "a lfs.lua in slurmctld's working directory was run"


def test_config_check_refuses_a_snapshot_the_filter_would_never_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuwarden.cli import cli
    from gpuwarden.config.context import Context

    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "slurm.conf").write_text("")
    (conf / "job_submit.lua").write_text("")
    env = {"SLURM_CONF": str(conf / "slurm.conf")}
    assert location.problem(str(conf / "gpuwarden-placement.lua"), env) == ""
    assert "is not beside" in location.problem("/var/lib/gpuwarden/snap.lua", env)
    assert location.problem("/var/lib/gpuwarden/snap.lua", {"SLURM_CONF": "/nonexistent/x"}) \
        == ""  # no filter installed there: nothing to check
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n")
    (bin_dir / "scontrol").chmod(0o755)
    cfg = tmp_path / "gw.toml"
    cfg.write_text(f"[slurm]\nbin_dir = '{bin_dir}'\n[placement]\n"
                   "snapshot_file = '/var/lib/gpuwarden/snap.lua'\n")
    monkeypatch.setenv("SLURM_CONF", str(conf / "slurm.conf"))
    res = CliRunner().invoke(cli, ["config", "check", str(cfg)], obj=Context())
    assert res.exit_code == 2 and "is not beside" in res.stderr, res.output


def test_explain_reads_an_sbatch_node_range() -> None:
    import click

    from gpuwarden.placement.cli import _node_range

    assert _node_range("4") == (4, 4) and _node_range("2-8") == (2, 8)
    for bad in ("x", "8-2", "0"):
        with pytest.raises(click.BadParameter):
            _node_range(bad)
