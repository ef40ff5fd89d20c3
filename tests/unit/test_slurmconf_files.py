"""`slurm-conf --check` on what Slurm does with the files slurm.conf names: a hook value is one
path (a comma is no separator), the plugins beside slurm.conf are read through links and must be
files, and Includes are read as Slurm reads them, within bounds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpuwarden.slurmconf import read as reader
from gpuwarden.slurmconf.needs import HOOKS
from tests.unit.test_slurmconf_check import conf_dir, finding, run

SITE_PROLOG = "/etc/slurm/site-prolog"


# ---- a hook line is one path --------------------------------------------------------------------
def test_prolog_paths_joined_by_a_comma_fail_every_job(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, f"Prolog={SITE_PROLOG},{HOOKS['Prolog']}\n")
    code, out = run(path, ["ckpt"])
    assert code == 1
    line = finding(out, "Prolog=")
    assert line.startswith("conflict") and "ONE path" in line and "every job's prolog" in line
    assert line.endswith(f"-> one line per path: Prolog={SITE_PROLOG} and "
                         f"Prolog={HOOKS['Prolog']}")


def test_a_comma_line_fails_jobs_even_beside_a_good_line(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, f"Epilog={HOOKS['Epilog']}\nEpilog=/site/a,/site/b\n")
    _code, out = run(path, ["health"])
    assert finding(out, "Epilog=").startswith("conflict")


def test_a_health_check_program_with_a_comma_runs_nothing(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, f"HealthCheckProgram=/site/hc,{HOOKS['HealthCheckProgram']}\n")
    _code, out = run(path, ["health"])
    line = finding(out, "HealthCheckProgram=/site/hc")
    assert line.startswith("conflict") and "no health check runs" in line
    assert f"set: HealthCheckProgram={HOOKS['HealthCheckProgram']}" in line


def test_the_health_check_program_is_no_glob(tmp_path: Path) -> None:
    d = tmp_path / "hc.d"
    d.mkdir()
    (d / "gpuwarden-healthcheck").write_text("")
    _code, out = run(conf_dir(tmp_path, f"HealthCheckProgram={d}/*\n"), ["health"])
    assert finding(out, "HealthCheckProgram=").startswith("conflict")


# ---- the plugins beside slurm.conf --------------------------------------------------------------
PLACEMENT = "JobSubmitPlugins=lua\nTopologyPlugin=topology/tree\n"


def test_a_job_submit_lua_link_that_leads_nowhere_is_absent(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, PLACEMENT, beside=("topology.conf",))
    (tmp_path / "job_submit.lua").symlink_to("/nonexistent/job_submit.lua")
    code, out = run(path, ["placement"])
    assert code == 1
    line = finding(out, "JobSubmitPlugins")
    assert line.startswith("conflict") and "slurmctld does not start" in line
    assert "a link to /nonexistent/job_submit.lua, which does not exist" in line


def test_a_job_submit_lua_linked_in_as_the_guide_does_is_read(tmp_path: Path) -> None:
    plugins = tmp_path / "opt" / "plugins"
    plugins.mkdir(parents=True)
    (plugins / "job_submit.lua").write_text("-- gpuwarden's filter\n")
    etc = tmp_path / "etc"
    etc.mkdir()
    path = conf_dir(etc, PLACEMENT, beside=("topology.conf",))
    (etc / "job_submit.lua").symlink_to(plugins / "job_submit.lua")
    _code, out = run(path, ["placement"])
    assert finding(out, "JobSubmitPlugins").startswith("ok ")


def test_a_job_submit_lua_that_is_a_directory_is_no_script(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, PLACEMENT, beside=("topology.conf",))
    (tmp_path / "job_submit.lua").mkdir()
    _code, out = run(path, ["placement"])
    assert "job_submit.lua: not a regular file" in finding(out, "JobSubmitPlugins")


def test_a_job_submit_lua_we_may_not_read_is_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = conf_dir(tmp_path, PLACEMENT, beside=("topology.conf", "job_submit.lua"))
    real_open = os.open

    def denied(name: str, *args: object, **kw: object) -> int:
        if str(name).endswith("job_submit.lua"):
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(reader.os, "open", denied)
    code, out = run(path, ["placement"])
    assert code == 2
    line = finding(out, "JobSubmitPlugins")
    assert line.startswith("unread") and "permission denied" in line
    assert "run it as root" in out[-1]


def test_a_topology_conf_link_that_leads_nowhere_is_no_topology(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, PLACEMENT, beside=("job_submit.lua",))
    (tmp_path / "topology.conf").symlink_to(tmp_path / "gone.conf")
    _code, out = run(path, ["placement"])
    line = finding(out, "TopologyPlugin")
    assert line.startswith("missing") and "which does not exist" in line


# ---- Includes -----------------------------------------------------------------------------------
def test_anything_after_an_includes_file_name_is_a_parse_error(tmp_path: Path) -> None:
    (tmp_path / "a.conf").write_text("AccountingStorageType=accounting_storage/slurmdbd\n")
    code, out = run(conf_dir(tmp_path, "Include a.conf b.conf\n"), ["lemon"])
    assert code == 1
    line = finding(out, "after Include")
    assert line.startswith("conflict") and "'b.conf'" in line
    # Slurm still reads a.conf before it stops on the rest.
    assert finding(out, "AccountingStorageType").startswith("ok ")


def test_an_include_fan_out_is_cut_short_not_followed_for_ever(tmp_path: Path) -> None:
    for i in range(16):
        (tmp_path / f"f{i}.conf").write_text(f"Include f{i + 1}.conf\n" * 8)
    (tmp_path / "f16.conf").write_text("ClusterName=x\n")
    start = time.monotonic()
    code, out = run(conf_dir(tmp_path, "Include f0.conf\n"), ["lemon"])
    assert time.monotonic() - start < 10
    assert code == 1
    line = finding(out, "more than 1000 Include lines")
    assert line.startswith("conflict") and "include each file once" in line


def test_an_include_named_several_times_is_read_each_time_as_slurm_does(tmp_path: Path) -> None:
    (tmp_path / "acct.conf").write_text("AccountingStorageType=accounting_storage/slurmdbd\n")
    path = conf_dir(tmp_path, "Include acct.conf\nAccountingStorageType=accounting_storage/none\n"
                              "Include acct.conf\n")
    code, out = run(path, ["lemon"])
    # The last value read wins: acct.conf's, read again by the second Include.
    assert finding(out, r"^ok .*AccountingStorageType=accounting_storage/slurmdbd")
    assert code == 1 and "is set 3 times" in finding(out, "is set")


def test_an_include_that_is_a_device_is_not_opened(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = os.open

    def spy(name: str, *args: object, **kw: object) -> int:
        opened.append(str(name))
        return real_open(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(reader.os, "open", spy)
    _code, out = run(conf_dir(tmp_path, "Include /dev/null\n"), ["lemon"])
    assert "Include /dev/null: not a regular file" in finding(out, "/dev/null")
    assert "/dev/null" not in opened
