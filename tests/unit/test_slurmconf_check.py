"""`gpuwarden slurm-conf --check`: a site's slurm.conf read as Slurm reads it, and what each
feature lacks in it said with the exact line to write."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpuwarden.slurmconf import check
from gpuwarden.slurmconf import read as reader
from gpuwarden.slurmconf.needs import FEATURES, HOOK_TIMEOUT_S, HOOKS, NEEDS

ALL = list(FEATURES)
REPO = Path(__file__).resolve().parents[2]


def conf_dir(tmp_path: Path, text: str, beside: tuple[str, ...] = ()) -> Path:
    (tmp_path / "slurm.conf").write_text(text)
    for name in beside:
        (tmp_path / name).write_text("-- gpuwarden\n")
    return tmp_path / "slurm.conf"


def run(path: Path, features: list[str] = ALL, wait_s: int = 300,
        defaults: str = "/nonexistent/default/gpuwarden",
        version: tuple[int, int] | None = None) -> tuple[int, list[str]]:
    out: list[str] = []
    code = check.check(str(path), features, wait_s, out.append, out.append,
                       defaults_file=defaults, slurm_version=version, version_from="test")
    return code, out


def finding(lines: list[str], pattern: str) -> str:
    hits = [line for line in lines[1:-1] if re.search(pattern, line)]
    assert len(hits) == 1, (pattern, lines)
    return hits[0]


# ---- the merged block and the check share one source ------------------------------------------
def test_the_block_passes_its_own_check(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "ClusterName=c\n" + check.block(),
                    beside=("job_submit.lua", "topology.conf"))
    code, out = run(path)
    assert code == 0, out
    assert out[-1].startswith("nothing missing for health gating")
    assert all(line.startswith(("#", "ok ", "nothing missing")) for line in out)


def test_the_block_sets_each_key_once() -> None:
    keys = [line.split("=", 1)[0] for line in check.block().splitlines()
            if line and not line.startswith("#")]
    assert len(keys) == len(set(keys))
    assert "SchedulerParameters=nohold_on_prolog_fail,max_switch_wait=3600" in check.block()
    assert f"PrologEpilogTimeout={HOOK_TIMEOUT_S}" in check.block()


def test_the_block_for_one_feature_has_only_its_lines() -> None:
    text = check.block(["lemon"])
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert settings == ["AccountingStorageType=accounting_storage/slurmdbd"]
    assert "job_submit.lua" not in text


def test_the_hooks_named_are_the_ones_gpuwarden_ships() -> None:
    for path in HOOKS.values():
        kind, name = path.split("/")[-2:]
        assert (REPO / "gpuwarden" / "sitefiles" / kind / name).is_file(), path


def test_the_timeout_rule_is_the_hooks_limit_plus_the_guides_margin() -> None:
    from gpuwarden.hooks.cli import WRAPPER_HOOK_LIMIT_S

    hook_sh = (REPO / "gpuwarden" / "sitefiles" / "prolog" / "gpuwarden-hook.sh").read_text()
    assert f"GW_HOOK_LIMIT={int(WRAPPER_HOOK_LIMIT_S)}" in hook_sh
    assert HOOK_TIMEOUT_S == WRAPPER_HOOK_LIMIT_S + 30 == 300


# ---- findings ----------------------------------------------------------------------------------
def test_an_empty_slurm_conf_lacks_everything_with_the_line_to_add(tmp_path: Path) -> None:
    code, out = run(conf_dir(tmp_path, "ClusterName=c\n"))
    assert code == 1
    assert finding(out, r"Prolog not set").endswith(f"-> add: Prolog={HOOKS['Prolog']}")
    assert finding(out, "HealthCheckInterval").endswith("-> set: HealthCheckInterval=300")
    assert finding(out, "lemon draining").endswith(
        "-> set: AccountingStorageType=accounting_storage/slurmdbd")
    # Slurm's defaults already do what gpuwarden needs for these.
    assert finding(out, "JobRequeue").startswith("ok ")
    assert finding(out, "HealthCheckNodeState").startswith("ok ")
    assert finding(out, "PrologEpilogTimeout").startswith("ok ")


def test_a_list_key_gets_one_merged_line_keeping_the_sites_own_options(tmp_path: Path) -> None:
    code, out = run(conf_dir(tmp_path, "SchedulerParameters=bf_continue,Max_Switch_Wait=60\n"),
                    ["health", "placement"], wait_s=7200)
    assert code == 1
    want = "SchedulerParameters=bf_continue,max_switch_wait=7200,nohold_on_prolog_fail"
    assert finding(out, "nohold_on_prolog_fail not in").endswith(f"-> set: {want}")
    # The wait a partition's policy asks for is longer than Slurm would let a job wait.
    assert finding(out, "below").startswith("conflict")


def test_a_key_given_twice_is_a_conflict_slurm_keeps_only_the_last(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "SchedulerParameters=nohold_on_prolog_fail\n"
                              "ReturnToService=2\n"
                              "SchedulerParameters=bf_continue   # added later by someone\n")
    code, out = run(path, ["health"])
    assert code == 1
    # The effective value is the last one: nohold is lost.
    assert finding(out, "nohold_on_prolog_fail not in").startswith("missing")
    dup = finding(out, "is set 2 times")
    assert "slurm.conf:1" in dup and "slurm.conf:3" in dup
    assert dup.endswith("keep one line: SchedulerParameters=nohold_on_prolog_fail,bf_continue")


def test_several_prolog_lines_are_all_run_so_one_of_them_is_enough(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "Prolog=/etc/slurm/site-prolog\n"
                              "Prolog=/usr/local/gw/bin/gpuwarden-prolog\n")
    _code, out = run(path, ["ckpt"])
    assert finding(out, "Prolog=").startswith("ok ")
    assert not any("is set 2 times" in line for line in out)


def test_a_prolog_glob_is_looked_up_on_this_host(tmp_path: Path) -> None:
    d = tmp_path / "prolog.d"
    d.mkdir()
    (d / "gpuwarden-prolog").write_text("")
    _code, out = run(conf_dir(tmp_path, f"Prolog={d}/*\n"), ["ckpt"])
    assert finding(out, "Prolog=").startswith("ok ")


def test_another_health_check_program_is_a_conflict(tmp_path: Path) -> None:
    _code, out = run(conf_dir(tmp_path, "HealthCheckProgram=/usr/sbin/nhc\n"), ["health"])
    line = finding(out, "HealthCheckProgram=/usr/sbin/nhc")
    assert line.startswith("conflict")
    assert f"set: HealthCheckProgram={HOOKS['HealthCheckProgram']}" in line


@pytest.mark.parametrize(("text", "severity"), [
    ("PrologEpilogTimeout=120\n", "conflict"),
    ("PrologEpilogTimeout=300\n", "ok"),
    ("PrologEpilogTimeout=120\nPrologTimeout=600\nEpilogTimeout=600\n", "ok"),  # 25.05+
    ("PrologEpilogTimeout=600\nEpilogTimeout=60\n", "conflict"),
])
def test_slurms_hook_timeout_must_outlast_the_hooks(tmp_path: Path, text: str,
                                                    severity: str) -> None:
    _code, out = run(conf_dir(tmp_path, text), ["ckpt"], version=(25, 5))
    assert finding(out, "Timeout").startswith(severity)


def test_before_25_05_the_own_timeouts_override_nothing(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "PrologEpilogTimeout=120\nPrologTimeout=600\n")
    _code, out = run(path, ["ckpt"], version=(24, 11))
    assert finding(out, "PrologEpilogTimeout=120 ").startswith("conflict")
    assert "needs Slurm >= 25.05, this is 24.11" in finding(out, "slurm.conf:2")


def test_a_lower_hook_limit_in_the_defaults_file_allows_a_shorter_timeout(tmp_path: Path) -> None:
    defaults = tmp_path / "default-gpuwarden"
    defaults.write_text("GPUWARDEN_PYTHON=/opt/gpuwarden/venv/bin/python\n"
                        "export GPUWARDEN_HOOK_LIMIT_S=30\nGPUWARDEN_HOOK_LIMIT_S=0\n")
    defaults.chmod(0o644)
    path = conf_dir(tmp_path, "PrologEpilogTimeout=60\n")
    _code, out = run(path, ["ckpt"], defaults=str(defaults))
    assert finding(out, "PrologEpilogTimeout").startswith("ok ")
    _code, out = run(path, ["ckpt"])
    line = finding(out, "PrologEpilogTimeout")
    assert line.startswith("conflict") and "set: PrologEpilogTimeout=300 (or " in line
    # The hooks ignore a defaults file others can write; so does the check.
    defaults.chmod(0o666)
    _code, out = run(path, ["ckpt"], defaults=str(defaults))
    assert finding(out, "PrologEpilogTimeout").startswith("conflict")


def test_the_defaults_file_is_the_one_the_hooks_read() -> None:
    for hook in HOOKS.values():
        kind, name = hook.split("/")[-2:]
        text = (REPO / "gpuwarden" / "sitefiles" / kind / name).read_text()
        assert check.DEFAULTS_FILE in text, hook


def test_job_submit_lua_without_the_script_says_slurmctld_will_not_start(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "JobSubmitPlugins=lua\nTopologyPlugin=topology/tree\n",
                    beside=("topology.conf",))
    code, out = run(path, ["placement"])
    assert code == 1
    line = finding(out, "JobSubmitPlugins")
    assert line.startswith("conflict") and "slurmctld does not start" in line


def test_adding_lua_is_told_to_come_after_the_script(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "JobSubmitPlugins=pbs\n")
    _code, out = run(path, ["placement"])
    line = finding(out, "JobSubmitPlugins")
    assert re.search(r"first copy job_submit.lua from gpuwarden's plugins/ .* to .*, then set: "
                     r"JobSubmitPlugins=pbs,lua$", line), line


def test_a_foreign_job_submit_lua_must_load_gpuwardens(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "JobSubmitPlugins=job_submit/lua\n")
    (tmp_path / "job_submit.lua").write_text("function slurm_job_submit() end\n")
    _code, out = run(path, ["placement"])
    assert "is not gpuwarden's" in finding(out, "JobSubmitPlugins")


def test_topology_block_needs_cli_filter_and_no_switch_wait(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "TopologyPlugin=topology/block\nJobSubmitPlugins=lua\n"
                              "CliFilterPlugins=lua\n", beside=("job_submit.lua", "topology.conf"))
    _code, out = run(path, ["placement"])
    assert "sbatch, salloc and srun stop" in finding(out, "CliFilterPlugins")
    assert not any("max_switch_wait" in line for line in out)


def test_only_the_features_asked_for_are_checked(tmp_path: Path) -> None:
    code, out = run(conf_dir(tmp_path, "AccountingStorageType=accounting_storage/slurmdbd\n"),
                    ["lemon"])
    assert code == 0
    assert [line.split()[0] for line in out[1:-1]] == ["ok"]


def test_every_need_names_a_known_feature() -> None:
    assert {f for n in NEEDS for f in n.features} == set(FEATURES)


# ---- reading slurm.conf as Slurm does ---------------------------------------------------------
def test_comments_continuations_escapes_and_case(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "healthcheckinterval=60 # every minute\n"
                              "PartitionName=gpu Nodes=c[1-4] \\\n  Default=YES\n"
                              "Epilog=/opt/x\\#1/gpuwarden-epilog\n"
                              "Prolog=/opt/a\\\\\n")
    conf = reader.read(str(path))
    assert [(s.key, s.value, s.line) for s in conf.settings] == [
        ("healthcheckinterval", "60", 1), ("PartitionName", "gpu", 2),
        ("Epilog", "/opt/x#1/gpuwarden-epilog", 4), ("Prolog", "/opt/a\\", 5)]
    assert conf.last("HealthCheckInterval") is not None
    assert conf.problems == ()


def test_two_settings_on_one_line_are_a_slurm_parse_error(tmp_path: Path) -> None:
    _code, out = run(conf_dir(tmp_path, "ReturnToService=2 JobRequeue=1\n"), ["ckpt"])
    assert "Slurm cannot parse 'JobRequeue=1'" in finding(out, "cannot parse")


def test_includes_relative_to_slurm_conf_with_cluster_name(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "gw-prod.conf").write_text("Include more.conf\n")
    (tmp_path / "more.conf").write_text("AccountingStorageType=accounting_storage/slurmdbd\n")
    path = conf_dir(tmp_path, "ClusterName=PROD\nInclude sub/gw-%c.conf\n")
    code, out = run(path, ["lemon"])
    assert code == 0, out
    assert "2 included file(s)" in out[0]


@pytest.mark.parametrize(("line", "why"), [
    ("Include missing.conf", "no such file"),
    ("Include conf.d/*.conf", "does not expand glob"),
    ("Include %c.conf", "needs a ClusterName"),
    ("Include slurm.conf", "includes itself"),
    ("Include fifo", "not a regular file"),
])
def test_includes_slurm_would_fail_on_are_conflicts(tmp_path: Path, line: str, why: str) -> None:
    os.mkfifo(tmp_path / "fifo")
    code, out = run(conf_dir(tmp_path, f"{line}\n"), ["lemon"])
    assert code == 1
    assert finding(out, why).startswith("conflict")


def test_an_include_we_may_not_read_makes_the_result_incomplete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "secret.conf").write_text("AccountingStorageType=accounting_storage/slurmdbd\n")
    real_open = os.open

    def no_secret(path: str, *args: object, **kw: object) -> int:
        if str(path).endswith("secret.conf"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(reader.os, "open", no_secret)
    code, out = run(conf_dir(tmp_path, "Include secret.conf\n"), ["lemon"])
    assert code == 2
    assert finding(out, "permission denied").startswith("unread")
    assert "run it as root" in out[-1]


def test_an_unreadable_slurm_conf_is_exit_2_with_what_to_do(tmp_path: Path) -> None:
    code, out = run(tmp_path / "nope.conf")
    assert code == 2
    assert out == [out[0]] and "give the path of slurm.conf" in out[0]


# ---- PrologFlags: no job code before every node's gate (issue 39) ------------------------------
def test_the_block_gates_every_node_before_the_batch_script() -> None:
    assert "\nPrologFlags=Alloc,DeferBatch\n" in check.block(["health"])
    assert "\nPrologFlags=Alloc,DeferBatch\n" in check.block(["ckpt"])
    assert "PrologFlags" not in check.block(["placement", "lemon"])


@pytest.mark.parametrize(("line", "want"), [
    ("", "PrologFlags=Alloc,DeferBatch"),
    ("PrologFlags=Alloc\n", "PrologFlags=Alloc,DeferBatch"),  # the admin's try in issue 39
    ("PrologFlags=X11,Serial\n", "PrologFlags=X11,Serial,DeferBatch"),  # X11 turns Alloc on
    ("PrologFlags=Contain\n", "PrologFlags=Contain,DeferBatch"),
    ("PrologFlags=DeferBatch\n", "PrologFlags=DeferBatch,Alloc"),  # without Alloc: no effect
])
def test_prolog_flags_lacking_alloc_or_deferbatch_get_one_merged_line(
        tmp_path: Path, line: str, want: str) -> None:
    code, out = run(conf_dir(tmp_path, line), ["health"])
    assert code == 1
    hits = [f for f in out if "PrologFlags" in f and f.startswith("missing")]
    assert hits and all(f.endswith(f"-> set: {want}") for f in hits), out


@pytest.mark.parametrize("line", ["PrologFlags=Alloc,DeferBatch", "prologflags=contain,deferbatch",
                                  "PrologFlags=RunInJob,DeferBatch,Serial"])
def test_prolog_flags_that_gate_every_node_first_pass(tmp_path: Path, line: str) -> None:
    _code, out = run(conf_dir(tmp_path, line + "\n"), ["health"])
    assert not [f for f in out if "PrologFlags" in f and not f.startswith("ok")], out


def test_nohold_is_a_conflict_with_the_line_without_it(tmp_path: Path) -> None:
    _code, out = run(conf_dir(tmp_path, "PrologFlags=Alloc,NoHold,DeferBatch\n"), ["health"])
    bad = finding(out, "NoHold lets the batch script start")
    assert bad.startswith("conflict") and bad.endswith("-> set: PrologFlags=Alloc,DeferBatch")
