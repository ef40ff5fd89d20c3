"""Reviewer reproductions (issue 11, items 3, 4 and 7): the prolog's fast path must trust only
a complete verdict, nothing gpuwarden starts may hold a hook past its limit, and every part of
gating that is off says so."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.ckpt import stagein
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.config.health import Expected, HealthConfig
from gpuwarden.health import fastgate, marker
from gpuwarden.health.gather import boot_time, gather, gating_gaps
from gpuwarden.health.model import GpuSnapshot, Status
from gpuwarden.health.probe import ProbeError
from gpuwarden.hooks import cli as hcli
from gpuwarden.hooks import entry
from tests.unit import pytrees
from tests.unit.test_entry import break_gpu, node_env  # noqa: F401 - the fixture `node` uses
from tests.unit.test_hooks import Node

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def node(node_env):  # type: ignore[no-untyped-def]  # noqa: F811
    return node_env


def _fast(env: entry.Env, tmp: Path) -> str:
    """What the fast path answers for the next job, with the settings a full prolog leaves."""
    run = tmp / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    environ = {"SLURMD_NODENAME": "c3", "GPUWARDEN_RUN_DIR": str(run),
               "GPUWARDEN_CONFIG": str(tmp / "none.toml")}
    (run / fastgate.SETTINGS).write_bytes(marshal.dumps(fastgate.settings_for(env.config, "c3",
                                                                              environ)))
    os.chmod(run / fastgate.SETTINGS, 0o600)
    shm = Path(env.config.ckpt.memory_root)
    shm.mkdir(exist_ok=True)
    os.chmod(shm, 0o1777)
    return fastgate.check(environ)


def _live(env: entry.Env, tmp: Path, **health: object) -> entry.Env:
    h = replace(env.config.health, prom_dir=str(tmp / "prom"), **health)  # type: ignore[arg-type]
    return replace(env, config=replace(env.config, health=h), clock=time.time)


# ---- 1: a prolog's verdict on the job's GPUs is not the node's --------------------------------
def test_a_prolog_verdict_on_the_jobs_gpus_is_never_trusted_for_every_gpu(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    env = _live(env, tmp)
    entry.periodic(env)
    slurm.log.clear()
    break_gpu(tmp, index=5)
    entry.periodic(env)  # the node's own verdict: CRITICAL (GPU 5)
    assert "gpuwarden_health_status{node=\"c3\"} 2" in (tmp / "prom" / "gpuwarden.prom").read_text()
    slurm.table["c3"] = replace(slurm.table["c3"], state="IDLE", reason="")  # an operator resumed
    stale = replace(env, clock=lambda: time.time() + 10 * env.config.health.verdict_max_age_s)
    job1 = replace(stale, environ={**env.environ, "SLURM_JOB_GPUS": "0,1"})
    assert entry.prolog(job1) == 0  # GPUs 0 and 1 are fine
    # The textfile still says what the node's last full verdict said.
    assert "gpuwarden_health_status{node=\"c3\"} 2" in (tmp / "prom" / "gpuwarden.prom").read_text()
    why = _fast(env, tmp)
    assert "did not check every GPU" in why
    # ...so the job on GPU 5 takes the full path, which stops it.
    assert entry.prolog(replace(env, environ={**env.environ, "SLURM_JOB_GPUS": "5"})) == 1


# ---- 2: what the epilog holds back is not "good" -----------------------------------------------
class SlowProbe:
    def snapshot(self) -> GpuSnapshot:
        time.sleep(30)
        raise AssertionError("not reached")


def test_an_epilog_gpu_timeout_is_stored_so_the_fast_path_refuses_it(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    env = replace(_live(env, tmp, check_timeout_s=0.3, epilog_budget_s=0.6,
                        prolog_budget_s=0.6),
                  environ={**env.environ, "SLURM_JOB_EXIT_CODE": "1"}, probe=SlowProbe())
    assert entry.epilog(env) == 0 and slurm.log == []
    saved = json.loads((tmp / "state" / "verdict.json").read_text())
    assert saved["status"] == "UNKNOWN" and saved["complete"] is False
    assert _fast(env, tmp) != ""
    assert entry.prolog(env) == 1  # the full prolog probes the GPUs again and judges


def test_after_an_epilog_held_a_result_back_the_next_prolog_runs_every_check(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    env = replace(env, environ={**env.environ, "SLURM_JOB_EXIT_CODE": "1"})
    # Short deadlines only where one must fire (the stuck probe's, in the epilog).
    held = replace(_live(env, tmp, check_timeout_s=0.3, epilog_budget_s=0.6), probe=SlowProbe())
    assert entry.epilog(held) == 0
    # The probe answers again: the next prolog judges the node afresh, node checks included
    # (a fresh complete verdict would have let it take scratch, memory and links as stored).
    # Its checks keep the fixture's generous deadline: none of them may time out here.
    assert entry.prolog(_live(env, tmp)) == 0 and slurm.log == []
    saved = json.loads((tmp / "state" / "verdict.json").read_text())
    assert saved["context"] == "prolog job 7" and saved["complete"] is True
    assert "scratch" in {r["check"] for r in saved["results"]}


# ---- 3: no child gpuwarden starts holds the hook's output ---------------------------------------
_ORPHAN = """
import subprocess, sys, time
from gpuwarden.health import fastgate
from gpuwarden.core import deadline
def stuck():
    subprocess.Popen(["sleep", "8"])  # stands in for a child stuck in the kernel
    time.sleep(60)
    return ""
if sys.argv[1] == "deadline":
    deadline.run_all({"stuck": stuck}, 0.3)
else:
    fastgate.in_child(stuck, 0.3)
"""


@pytest.mark.parametrize("runner", ["deadline", "fastgate"])
def test_an_abandoned_check_child_does_not_hold_stdout_or_stderr(runner: str) -> None:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", _ORPHAN, runner], cwd=REPO, capture_output=True,
                   timeout=30, check=True)
    assert time.monotonic() - t0 < 5  # capture_output read both pipes to their end


def test_the_wrapper_does_not_wait_for_a_child_left_holding_its_output() -> None:
    with pytrees.root_only_dir() as d:
        _child_holding_output(Node(d))


def _child_holding_output(box: Node) -> None:
    box.python(box.script("python3", "( exec sleep 8 ) &\nexit 0\n"))
    t0 = time.monotonic()
    assert box.run().returncode == 0
    assert time.monotonic() - t0 < 5


# ---- 4: the prolog's limit covers stage-in; the watchdog ends what the prolog started ----------
def test_the_prologs_limit_covers_checkpoint_stage_in() -> None:
    cfg = replace(Config(), ckpt=CkptConfig(shared_root="/fsx/ckpt"))
    h = cfg.health
    limit = hcli.run_limit("prolog", h.prolog_budget_s, hcli.stage_in_s(cfg, "prolog"))
    assert limit >= 2 * h.prolog_budget_s + cfg.ckpt.stage_in_budget_s
    assert limit + hcli.WATCHDOG_GRACE_S < hcli.WRAPPER_HOOK_LIMIT_S


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


def test_a_watchdog_firing_during_stage_in_kills_the_copier(node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env, _, _ = node
    pidfile = tmp_path / "copier.pid"
    req = stagein.Request("7", os.getuid(), os.getgid(), tuple(os.getgroups()), "c3", ("c3",),
                          str(tmp_path / "shm"), str(tmp_path / "shared"), 120.0)

    def copy() -> int:
        pidfile.write_text(str(os.getpid()))
        time.sleep(60)
        return 0

    def prolog(e: entry.Env) -> int:
        stagein.run_as(copy, req)
        return 0

    assert entry.run(env, prolog, "prolog", watchdog_s=1.0) == 0
    assert "deadline" in env.problems
    end = time.monotonic() + 5
    while not (pidfile.exists() and _gone(int(pidfile.read_text()))):
        assert time.monotonic() < end, "the copier outlived the prolog"
        time.sleep(0.05)


# ---- 5: a probe that cannot run on a GPU node is gating off, loudly ----------------------------
class NoNvml:
    def snapshot(self) -> GpuSnapshot:
        raise ProbeError("pynvml is not installed: pip install 'gpuwarden[nvml]'")


def test_no_gpu_probe_on_a_gpu_node_is_reported_as_gating_off(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    env = replace(_live(env, tmp), probe=NoNvml())
    entry.run(env, entry.periodic, "health check", watchdog_s=30)
    assert slurm.log == []  # an install problem never drains
    assert "GPU gating off" in env.problems["config"]
    note = marker.describe(marker.decode(slurm.table["c3"].extra), time.time())
    assert note.startswith("health gating off") and "config" in note
    assert 'gpuwarden_health_self_error{reason="config"} 1' in \
        (tmp / "prom" / "gpuwarden_self.prom").read_text()


def test_no_gpu_probe_on_a_cpu_node_is_not_a_gap(node) -> None:  # type: ignore[no-untyped-def]
    env, _, _ = node
    h = env.config.health
    v = gather(h, "c3", "t", 30.0, probe=NoNvml())  # type: ignore[arg-type]
    assert gating_gaps(v, h.expected) and not gating_gaps(v, Expected(gpu_count=0))


def test_an_unreadable_kernel_log_is_xid_detection_off(node) -> None:  # type: ignore[no-untyped-def]
    env, _, tmp = node
    env = _live(env, tmp, kernel_log=str(tmp / "missing.log"))
    entry.periodic(env)
    assert "XID detection off" in env.problems["config"]


# ---- 6: a node without a marker is not shown healthy ------------------------------------------
def test_a_node_without_a_health_marker_is_flagged() -> None:
    assert marker.NO_MARKER and marker.describe(None, time.time()) == marker.NO_MARKER


# ---- 7: a state directory gpuwarden cannot trust never turns the checks off ---------------------
def test_an_untrusted_state_dir_still_runs_every_prolog_check(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    (tmp / "state").mkdir()
    os.chmod(tmp / "state", 0o770)  # e.g. installed with umask 002
    break_gpu(tmp)
    assert entry.run(env, entry.prolog, "prolog", watchdog_s=30) == 1
    assert slurm.log == ["drain c3", "requeue 7"] and "state" in env.problems


# ---- 8: one consistent set of time limits ------------------------------------------------------
def _sh_const(name: str) -> float:
    for line in (REPO / "prolog" / "gpuwarden-hook.sh").read_text().splitlines():
        if line.startswith(f"{name}="):
            return float(line.split("=", 1)[1])
    raise AssertionError(name)


def test_time_limits_nest_python_in_wrapper_in_slurm() -> None:
    assert _sh_const("GW_HEALTHCHECK_LIMIT") == hcli.WRAPPER_HEALTHCHECK_LIMIT_S < 60
    assert _sh_const("GW_HOOK_LIMIT") == hcli.WRAPPER_HOOK_LIMIT_S
    guide = (REPO / "docs" / "admin-guide.md").read_text()
    timeouts = {int(line.split("=")[1].split()[0]) for line in guide.splitlines()
                if line.startswith("PrologEpilogTimeout=")}
    assert len(timeouts) == 1 and timeouts.pop() >= hcli.WRAPPER_HOOK_LIMIT_S + 30
    cfg = replace(Config(), ckpt=CkptConfig(shared_root="/fsx/ckpt"))
    h = cfg.health
    for what, budget in (("prolog", h.prolog_budget_s), ("epilog", h.epilog_budget_s),
                         ("health check", h.periodic_budget_s)):
        limit = hcli.run_limit(what, budget, hcli.stage_in_s(cfg, what))
        wrapper = hcli.WRAPPER_HEALTHCHECK_LIMIT_S if what == "health check" \
            else hcli.WRAPPER_HOOK_LIMIT_S
        assert limit + hcli.WATCHDOG_GRACE_S < wrapper, what
    # The wrapper's own limit, passed on, bounds Python's too; the health check never past 55 s.
    assert hcli.run_limit("prolog", 15.0, 120.0, hcli.hook_limit({"GPUWARDEN_HOOK_LIMIT_S":
                                                                  "60"})) == 50.0
    assert hcli.run_limit("health check", 60.0, 0.0, 600.0) == hcli.HEALTHCHECK_LIMIT_S


@pytest.mark.parametrize(("hook", "value", "effective"), [
    ("healthcheck", "600", "55"), ("prolog", "0", "270"), ("prolog", "007", "270"),
    ("prolog", "2", "2")])
def test_the_wrapper_keeps_its_limits(hook: str, value: str, effective: str) -> None:
    with pytrees.root_only_dir() as d:
        _keeps_limits(Node(d), hook, value, effective)


def _keeps_limits(box: Node, hook: str, value: str, effective: str) -> None:
    box.python(box.script("python3", 'echo "limit=$GPUWARDEN_HOOK_LIMIT_S"\n'))
    with box.defaults.open("a") as f:
        f.write(f"GPUWARDEN_HOOK_LIMIT_S={value}\n")
    assert f"limit={effective}" in box.run(hook).stdout


# ---- XID from a rendering anyone can forge: never a drain --------------------------------------
def test_an_xid_from_a_forgeable_rendering_never_drains(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    now = time.time()
    line = (f"{time.strftime('%b %e %H:%M:%S', time.localtime(now - 5))} c3 kernel: "
            f"[{now - 5 - boot_time():.6f}] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has "
            "fallen off the bus.\n")
    klog = tmp / "syslog"
    klog.write_text(line)
    env = _live(env, tmp, kernel_log=str(klog))
    entry.periodic(env)
    assert slurm.log == [] and "XID drains off" in env.problems["config"]
    saved = json.loads((tmp / "state" / "verdict.json").read_text())
    xids = [r for r in saved["results"] if r["check"].startswith("xid")]
    assert xids and all(r["status"] == "WARNING" and "/dev/kmsg" in r["message"] for r in xids)
    assert Status[saved["status"]] == Status.WARNING


def test_the_same_xid_from_kmsg_rendering_drains(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    at_us = int((time.time() - 5 - boot_time()) * 1e6)
    klog = tmp / "kmsg.log"
    klog.write_text(f"3,100,{at_us},-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen "
                    "off the bus.\n")
    entry.periodic(_live(env, tmp, kernel_log=str(klog)))
    assert slurm.log == ["drain c3"]


def test_health_config_defaults_are_what_the_limits_assume() -> None:
    assert HealthConfig().prolog_budget_s == 15.0 and CkptConfig().stage_in_budget_s == 120.0


# ---- the fast path's freshness does not move with the wall clock ------------------------------
def test_a_backward_clock_step_never_hides_an_xid_from_the_fast_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reproduced: chrony stepped the clock back 400 s; /proc/stat's btime moved with it, so
    an Xid 100 s after the verdict read as older than the verdict."""
    boot = 1_700_000_000.0
    verdict_up = time.monotonic()  # the verdict's moment on this boot's monotonic clock
    xid_us = int((verdict_up + 100) * 1e6)
    klog = tmp_path / "kmsg.log"
    klog.write_text(f"3,100,{xid_us},-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has "
                    "fallen off the bus.\n")
    at = boot + verdict_up
    monkeypatch.setattr(fastgate, "_boot_time", lambda: boot - 400)  # after the step
    since = at - 60 - fastgate.CLOCK_SLACK_S
    since_up = verdict_up - 60 - fastgate.CLOCK_SLACK_S
    assert fastgate.driver_records_since(str(klog), since, since_up)


def test_a_verdict_from_another_boot_is_not_fresh(node) -> None:  # type: ignore[no-untyped-def]
    env, _, tmp = node
    env = _live(env, tmp)
    entry.periodic(env)
    assert "this boot" not in _fast(env, tmp)  # (the fake GPU file is newer: the full way)
    path = tmp / "state" / fastgate.VERDICT  # what the fast path reads of the verdict
    doc = marshal.loads(path.read_bytes())
    path.write_bytes(marshal.dumps({**doc, "boot_id": "another boot"}))
    assert "this boot" in _fast(env, tmp)
    path.write_bytes(marshal.dumps({**doc, "mono": time.monotonic() - 3600}))  # wall clock: fresh
    assert "this boot" in _fast(env, tmp)


def test_the_fast_path_is_never_set_up_from_defaults(tmp_path: Path) -> None:
    environ = {"GPUWARDEN_CONFIG": str(tmp_path / "absent.toml"),
               "GPUWARDEN_RUN_DIR": str(tmp_path / "run"), "SLURMD_NODENAME": "c1"}
    assert "no config file" in fastgate.remember(environ)
    assert not (tmp_path / "run" / fastgate.SETTINGS).exists()
