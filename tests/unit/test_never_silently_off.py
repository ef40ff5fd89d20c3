"""Issue 11 item 4: gating acts before it persists, survives kills and full disks, finds
Slurm without PATH, and every failure of its own shows where an operator looks."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.core.logsetup import SyslogHandler
from gpuwarden.health import marker, store
from gpuwarden.health.probe import healthy_fake
from gpuwarden.hooks import entry
from gpuwarden.hooks.cli import HEALTHCHECK_LIMIT_S, run_limit
from gpuwarden.slurm import bindir
from gpuwarden.slurm.runner import SubprocessRunner
from tests.unit.test_entry import break_gpu, node_env  # noqa: F401 - the fixture below uses it

NOW = 1_800_000_000.0


@pytest.fixture
def node(node_env):  # type: ignore[no-untyped-def]  # noqa: F811
    """A node c3 with fake GPUs, a fake Slurm and its state in tmp (see test_entry)."""
    return node_env


def enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


# ---- act before persisting -----------------------------------------------------------------
def test_a_full_disk_never_stops_a_drain(node, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    break_gpu(tmp)
    monkeypatch.setattr(store, "atomic_write", enospc)
    with caplog.at_level(logging.ERROR):
        assert entry.periodic(env) == 0
    assert slurm.log == ["drain c3"]
    assert not (tmp / "state" / "verdict.json").exists()
    assert "state" in env.problems and "No space left" in env.problems["state"]
    assert any(r.levelno == logging.ERROR and "No space left" in r.getMessage()
               for r in caplog.records)


def test_a_full_disk_in_the_prolog_and_epilog_still_drains(node, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    break_gpu(tmp)
    monkeypatch.setattr(store, "atomic_write", enospc)
    assert entry.prolog_gate(env) == 1 and slurm.log == ["drain c3", "requeue 7"]
    slurm.resume("c3")
    failed = replace(env, environ={**env.environ, "SLURM_JOB_EXIT_CODE": "256"}, problems={})
    assert entry.epilog(failed) == 0 and slurm.log[-1] == "drain c3"


# (A short or failed write of a state file itself: test_safefs.py.)


# ---- a kill at any point keeps the node able to come back ----------------------------------
def test_killed_between_drain_and_saving_counters_still_resumes(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    break_gpu(tmp)
    entry.periodic(env)
    assert slurm.table["c3"].reason.endswith("[health]")
    (tmp / "state" / "counters.json").unlink()  # as if killed before they were saved
    (tmp / "gpus.json").write_text(healthy_fake(8))
    entry.periodic(env)
    entry.periodic(env)
    assert slurm.log == ["drain c3", "resume c3"]


def test_a_gpuwarden_drain_by_hand_is_never_taken_for_health_gatings(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node
    slurm.drain("c3", "RMA ticket 7")
    for _ in range(4):
        entry.periodic(env)
    assert slurm.log == ["drain c3"]


def test_drain_by_hand_refuses_the_health_tag() -> None:
    res = CliRunner().invoke(cli, ["drain", "c3", "--reason", "fake [health]"], obj=Context())
    assert res.exit_code == 2 and "reserved" in res.stderr


# ---- epilog: a job's failure is never evidence ---------------------------------------------
def test_many_failing_jobs_on_a_healthy_node_never_drain(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node
    for job in range(40):
        failed = replace(env, environ={**env.environ, "SLURM_JOB_ID": str(job),
                                       "SLURM_JOB_EXIT_CODE": "256"})
        assert entry.epilog(failed) == 0
    assert slurm.log == []


def test_a_job_that_fills_scratch_and_fails_does_not_drain_in_the_epilog(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node
    h = env.config.health
    full = replace(h, expected=replace(h.expected, scratch_min_free_gb=1e9))
    env = replace(env, config=replace(env.config, health=full),
                  environ={**env.environ, "SLURM_JOB_EXIT_CODE": "256"})
    for _ in range(5):
        assert entry.epilog(env) == 0
    assert slurm.log == []
    shown = store.Store(h.state_dir).load_verdict()
    assert shown is not None and shown.status.name == "WARNING"


def test_what_a_job_can_fill_never_drains_in_any_hook(node) -> None:  # type: ignore[no-untyped-def]
    """Full scratch or memory held by a user's processes: a warning everywhere, never a drain
    (the periodic check and the prolog drained here before: one user could take out a node)."""
    env, slurm, _ = node
    h = env.config.health
    full = replace(h, expected=replace(h.expected, scratch_min_free_gb=1e9,
                                       min_available_memory_mb=10**9))
    env = replace(env, config=replace(env.config, health=full))
    assert entry.periodic(env) == 0
    assert entry.prolog_gate(env) == 0
    assert slurm.log == []
    shown = store.Store(h.state_dir).load_verdict()
    assert shown is not None and shown.status.name == "WARNING"
    assert {r.check for r in shown.results if r.status.name == "WARNING"} >= {"scratch", "memory"}


def test_the_epilog_still_drains_on_hardware_evidence(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    break_gpu(tmp)
    failed = replace(env, environ={**env.environ, "SLURM_JOB_EXIT_CODE": "256"})
    entry.epilog(failed)
    assert slurm.log == ["drain c3"]


# ---- visible: metrics, marker in Slurm, syslog ---------------------------------------------
def with_prom(env: entry.Env, tmp: Path) -> entry.Env:
    h = replace(env.config.health, prom_dir=str(tmp / "prom"))
    return replace(env, config=replace(env.config, health=h), problems={})


def self_prom(tmp: Path) -> str:
    return (tmp / "prom" / "gpuwarden_self.prom").read_text()


def last_success(text: str) -> float:
    # The value as Prometheus reads it (prometheus_client writes 1.8e+09 for 1800000000).
    from prometheus_client.parser import text_string_to_metric_families

    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "gpuwarden_health_last_success_timestamp_seconds"]
    assert len(found) == 1, text
    return found[0]


def test_self_error_metric_and_last_success(node, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env, _, tmp = node
    entry.periodic(with_prom(env, tmp))
    text = self_prom(tmp)
    assert 'gpuwarden_health_self_error{reason="state"} 0' in text
    assert last_success(text) == NOW
    real = store.atomic_write
    monkeypatch.setattr(store, "atomic_write", lambda d, n, *a: enospc() if n.endswith(".json")
                        else real(d, n, *a))
    later = replace(with_prom(env, tmp), clock=lambda: NOW + 300)
    entry.periodic(later)
    text = self_prom(tmp)
    assert 'gpuwarden_health_self_error{reason="state"} 1' in text
    assert last_success(text) == NOW


def test_the_marker_in_slurm_says_when_the_node_last_checked(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node
    entry.periodic(env)
    m = marker.decode(slurm.table["c3"].extra)
    assert m == marker.Marker(int(NOW), "OK", "", 0)
    entry.periodic(replace(env, clock=lambda: NOW + 300))
    assert marker.decode(slurm.table["c3"].extra) == m  # nothing changed: not posted again
    off = replace(env, config=replace(env.config, health=replace(env.config.health, drain=False)),
                  clock=lambda: NOW + 600)
    entry.periodic(off)
    m = marker.decode(slurm.table["c3"].extra)
    assert m is not None and m.off == "drain = false" and m.since == int(NOW + 600)


def test_the_marker_keeps_operator_data(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node
    slurm.table["c3"] = replace(slurm.table["c3"], extra='{"rack":"B07"}')
    entry.periodic(env)
    doc = json.loads(slurm.table["c3"].extra)
    assert doc["rack"] == "B07" and doc[marker.KEY]["st"] == "OK"
    slurm.table["c3"] = replace(slurm.table["c3"], extra="rack B07 u12")
    entry.periodic(replace(env, clock=lambda: NOW + 5000))
    assert slurm.table["c3"].extra == "rack B07 u12"


def test_nodes_shows_gating_off_and_stale_with_since_when(tmp_path: Path) -> None:
    from tests.unit.test_cli import FakeClient
    from tests.unit.test_cli import node as cli_node

    (tmp_path / "g.toml").write_text("")

    off = marker.encode_into("", marker.Marker(int(time.time()), "UNKNOWN", "config",
                                               1_800_000_000))
    old = marker.encode_into("", marker.Marker(int(time.time() - 3 * 3600), "OK"))
    fresh = marker.encode_into("", marker.Marker(int(time.time()), "OK"))
    client = FakeClient({"c1": cli_node("c1", extra=off or ""),
                         "c2": cli_node("c2", extra=old or ""),
                         "c3": cli_node("c3", extra=fresh or "")})
    ctx = Context(config_path=str(tmp_path / "g.toml"),
                  client_factory=lambda cfg: client)  # type: ignore[arg-type,return-value]
    res = CliRunner().invoke(cli, ["nodes"], obj=ctx)
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines()}
    assert "health gating off since 2027-01-15T08:00:00Z: config" in lines["c1"]
    assert "health verdict stale: last check" in lines["c2"] and "3.0 h ago" in lines["c2"]
    assert "health" not in lines["c3"]
    assert "off or stale on 2 node(s)" in res.stderr


def test_errors_reach_syslog(tmp_path: Path) -> None:
    path = str(tmp_path / "log")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    handler = SyslogHandler(path)
    logger = logging.getLogger("test.syslog")
    logger.addHandler(handler)
    try:
        logger.info("not this one")
        logger.error("scontrol not found")
        got = sock.recv(4096).decode()
    finally:
        logger.removeHandler(handler)
        handler.close()
        sock.close()
    assert got.startswith("<27>gpuwarden[") and got.endswith("scontrol not found")


def test_a_missing_syslog_never_stops_anything(tmp_path: Path) -> None:
    handler = SyslogHandler(str(tmp_path / "absent"))
    handler.emit(logging.LogRecord("x", logging.ERROR, "", 0, "boom", None, None))


# ---- one rule for a missing or broken config ------------------------------------------------
def hook(args: list[str], config: str, monkeypatch: pytest.MonkeyPatch,
         client: object = None) -> tuple[int, str]:
    monkeypatch.setenv("SLURMD_NODENAME", "c3")
    ctx = Context(config_path=config, client_factory=lambda cfg: client)  # type: ignore[arg-type,return-value]
    res = CliRunner().invoke(cli, args, obj=ctx)
    return res.exit_code, res.stderr


def test_missing_and_broken_configs_fail_open_loudly_in_the_hooks(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tests.fakes import FakeSlurm
    from tests.unit.test_gate import fleet

    slurm = FakeSlurm({n.name: n for n in fleet()})
    broken = tmp_path / "broken.toml"
    broken.write_text(f"[health]\nprom_dir = '{tmp_path / 'prom'}'\ndrian = true\n")
    for config in (str(tmp_path / "absent.toml"), str(broken)):
        for cmd in ("prolog", "epilog", "periodic"):
            code, err = hook(["health", cmd], config, monkeypatch, slurm)
            assert code == 0 and "OFF on this node" in err
    assert 'gpuwarden_health_self_error{reason="config"} 1' in self_prom(tmp_path)
    m = marker.decode(slurm.table["c3"].extra)
    assert m is not None and m.off == "config"
    assert slurm.log == []


def test_commands_exit_2_on_a_missing_config(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for args in (["nodes"], ["resume", "c3"], ["health", "show"], ["health", "check"]):
        code, err = hook(args, str(tmp_path / "absent.toml"), monkeypatch)
        assert code in (2, 3) and "file not found" in err


# ---- Slurm's commands without PATH ----------------------------------------------------------
def fake_slurm_install(root: Path) -> Path:
    (root / "sbin").mkdir(parents=True, mode=0o755)
    (root / "bin").mkdir(mode=0o755)
    root.chmod(0o755)
    shutil.copy("/bin/sleep", root / "sbin" / "slurmd")
    scontrol = root / "bin" / "scontrol"
    scontrol.write_text("#!/bin/sh\necho scontrol ran \"$@\"\n")
    scontrol.chmod(0o755)
    return root


def test_slurm_is_found_beside_the_running_slurmd_without_path(tmp_path: Path) -> None:
    root = fake_slurm_install(tmp_path / "opt-slurm")
    daemon = subprocess.Popen([str(root / "sbin" / "slurmd"), "30"])
    try:
        deadline = time.monotonic() + 5
        place = None
        while time.monotonic() < deadline:
            try:
                place = bindir.locate("", use_path=False, environ={}, well_known=())
                break
            except bindir.SlurmNotFoundError:
                time.sleep(0.05)
        assert place is not None and place.path == str(root / "bin")
        runner = SubprocessRunner(lambda: bindir.locate("", use_path=False, environ={},
                                                        well_known=()).path)
        res = runner.run(["scontrol", "ping"], timeout=5)
        assert res.stdout.strip() == "scontrol ran ping"
    finally:
        daemon.kill()
        daemon.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a process of another uid)")
def test_a_users_process_named_slurmd_is_not_trusted() -> None:
    """Found in review: any user can run a program named slurmd from a directory of theirs."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="gpuwarden-slurmd-"))  # one another uid can reach
    base.chmod(0o755)
    root = fake_slurm_install(base / "opt-slurm")
    daemon = subprocess.Popen([str(root / "sbin" / "slurmd"), "30"], user=65534, group=65534)
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert [p.path for p in bindir.daemon_dirs() if p.path.startswith(str(base))] == []
            time.sleep(0.1)
    finally:
        daemon.kill()
        daemon.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_no_slurm_anywhere_names_the_config_key(tmp_path: Path) -> None:
    with pytest.raises(bindir.SlurmNotFoundError, match=r"set \[slurm\] bin_dir"):
        bindir.locate("", use_path=False, environ={"PATH": "/usr/bin"}, proc=str(tmp_path),
                      well_known=(str(tmp_path),))


def test_a_writable_slurm_dir_is_refused(tmp_path: Path) -> None:
    root = fake_slurm_install(tmp_path / "s")
    (root / "bin").chmod(0o777)
    with pytest.raises(bindir.SlurmNotFoundError, match="writable by group or others"):
        bindir.locate(str(root / "bin"), use_path=False)


def test_slurm_conf_installation_is_a_candidate() -> None:
    places = bindir.conf_dirs({"SLURM_CONF": "/opt/slurm-24.11/etc/slurm.conf"})
    assert "/opt/slurm-24.11/bin" in [p.path for p in places]


# ---- the whole health check ends before Slurm's kill ---------------------------------------
def test_the_health_check_run_ends_before_slurms_60_s_kill() -> None:
    assert run_limit("health check", 60.0) == HEALTHCHECK_LIMIT_S <= 45
    assert run_limit("health check", 10.0) == 20.0


def test_a_stuck_run_is_stopped_and_reported(node) -> None:  # type: ignore[no-untyped-def]
    env, _, _ = node
    t0 = time.monotonic()
    assert entry.run(env, lambda e: time.sleep(30) or 0, "health check", watchdog_s=0.3) == 0
    assert time.monotonic() - t0 < 5 and "deadline" in env.problems


def test_settle_waits_leave_time_for_the_drain(node) -> None:  # type: ignore[no-untyped-def]
    env, _, _ = node
    slept: list[float] = []
    env = replace(env, sleep=slept.append, end=time.monotonic() + 3.0)
    env.bounded_sleep(30.0)
    assert slept and slept[0] <= 1.0
