"""Prolog, epilog and health check logic with a fake Slurm and the fake GPU probe."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.config.health import Expected, HealthConfig
from gpuwarden.health.model import Status
from gpuwarden.health.probe import FakeGpuProbe, healthy_fake
from gpuwarden.hooks import entry
from gpuwarden.launch.decide import Lost
from gpuwarden.launch.report import comment
from gpuwarden.slurm.client import gpuwarden_reason
from gpuwarden.slurm.drain_cap import BlastRadius
from gpuwarden.slurm.models import Job, Node, NodeView
from tests.unit.test_gate import NOW, FakeSlurm, fleet


@pytest.fixture
def node_env(tmp_path: Path) -> tuple[entry.Env, FakeSlurm, Path]:
    gpus = tmp_path / "gpus.json"
    gpus.write_text(healthy_fake(8))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    # A generous check deadline: no test of this fixture is about one firing (those that are
    # set their own), and a loaded machine must not turn a slow check into a timeout.
    health = HealthConfig(
        state_dir=str(tmp_path / "state"), gpu_probe="fake", fake_gpu_file=str(gpus),
        kernel_log=str(kmsg), check_timeout_s=30.0, resume_after_passes=2,
        expected=Expected(gpu_count=8, nvlink_links=18, scratch_path=str(tmp_path)),
        blast_radius=BlastRadius(max_drained_pct=25.0, settle_s=0))
    slurm = FakeSlurm({n.name: n for n in fleet()})
    # Tier 0's spool in the test's own directory: the prolog creates it on every job.
    ckpt = CkptConfig(memory_root=str(tmp_path / "shm"))
    env = entry.Env(config=replace(Config(), health=health, ckpt=ckpt),  # type: ignore[arg-type]
                    client=slurm,
                    environ={"SLURMD_NODENAME": "c3", "SLURM_JOB_ID": "7"},
                    probe=FakeGpuProbe(str(gpus)), clock=lambda: NOW, sleep=lambda s: None)
    return env, slurm, tmp_path


def break_gpu(tmp: Path, index: int = 5) -> None:
    import json

    doc = json.loads((tmp / "gpus.json").read_text())
    doc["gpus"][index]["ecc_uncorrected_volatile"] = 1
    (tmp / "gpus.json").write_text(json.dumps(doc))


def test_prolog_on_a_healthy_node_lets_the_job_run(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node_env
    assert entry.prolog(env) == 0 and slurm.log == []


def test_prolog_on_a_bad_gpu_drains_and_fails_the_job(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    break_gpu(tmp)
    assert entry.prolog(env) == 1
    # Requeued by the prolog itself before it fails the job (issue 39): no node may start the
    # batch script between Slurm's "prolog complete" and its own requeue.
    assert slurm.log == ["drain c3", "requeue 7"]
    # The first word says the prolog refused a job here (the report counts those).
    assert slurm.table["c3"].reason == \
        "gpuwarden: prolog: 1 uncorrectable ECC errors on GPU 5 [health]"


def test_prolog_checks_only_the_jobs_gpus(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    entry.periodic(replace(env, probe=FakeGpuProbe(str(tmp / "gpus.json"))))  # fresh verdict
    break_gpu(tmp, index=5)
    env = replace(env, environ={**env.environ, "SLURM_JOB_GPUS": "0,1"})
    assert entry.prolog(env) == 0 and slurm.log == []


def test_prolog_past_the_cap_lets_the_job_run_and_says_would_drain(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    for name in ("c1", "c2"):
        slurm.drain(name, "earlier")
    slurm.log.clear()
    break_gpu(tmp)
    assert entry.prolog(env) == 0
    assert slurm.log == [] and slurm.table["c3"].comment.startswith("gpuwarden: would drain")


class RacedSlurm(FakeSlurm):
    """Another gpuwarden run on the node (its periodic check) drains it with the same evidence
    between the prolog's read of the node and the prolog's own drain."""

    def __init__(self, table: dict[str, Node]) -> None:
        super().__init__(table)
        self.raced = False

    def out_of_service(self, also: Sequence[str] = ()) -> NodeView:
        if not self.raced:
            self.raced = True
            reason = "periodic: 1 uncorrectable ECC errors on GPU 5 [health]"
            self.table["c3"] = replace(self.table["c3"], state=("IDLE", "DRAIN"),
                                       reason=gpuwarden_reason(reason),
                                       reason_changed_at=int(self.now))
        return super().out_of_service(also)


def test_prolog_fails_the_job_when_the_periodic_check_drained_the_node_first(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    raced = RacedSlurm(slurm.table)
    break_gpu(tmp)
    # The node is out with gpuwarden's reason: Slurm keeps it and requeues the job elsewhere,
    # instead of the job starting on a broken GPU.
    assert entry.prolog(replace(env, client=raced)) == 1
    assert raced.table["c3"].reason.startswith("gpuwarden: periodic: ")
    assert raced.log == ["requeue 7"]  # no drain of its own; the job requeued first


def test_prolog_lets_the_job_run_when_the_other_drain_was_undone_at_the_cap(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    raced = RacedSlurm(slurm.table)

    def other_run_ranks_its_drain(_s: float) -> None:  # past the cap: it undoes its drain
        if raced.raced:
            raced.table["c3"] = replace(raced.table["c3"], state=("IDLE",), reason="")

    break_gpu(tmp)
    # Failing the job now would have Slurm drain the node ("Prolog error") past the cap.
    assert entry.prolog(replace(env, client=raced, sleep=other_run_ranks_its_drain)) == 0
    assert not raced.table["c3"].drained


def _unranked_periodic_drain(slurm: FakeSlurm) -> None:
    # The periodic check drained c3 and was stopped before it ranked the drain (its counters
    # do not record it as kept): the prolog starting there ranks it again.
    slurm.table["c3"] = replace(
        slurm.table["c3"], state=("MIXED", "DRAIN"), reason_changed_at=int(NOW),
        reason=gpuwarden_reason("periodic: 1 uncorrectable ECC errors on GPU 5 [health]"))


def test_prolog_never_fails_the_job_on_a_drain_it_undid_at_the_cap(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    for name in ("c1", "c2"):  # earlier drains fill the cap of 2 of 8
        slurm.table[name] = replace(slurm.table[name], state=("IDLE", "DRAIN"),
                                    reason="gpuwarden: earlier", reason_changed_at=int(NOW - 60))
    _unranked_periodic_drain(slurm)
    break_gpu(tmp)
    # The drain is undone, the node is in service: exit 1 would have Slurm drain it past the
    # cap ("Prolog error"). The old prolog decided from the node as read before acting.
    assert entry.prolog(env) == 0 and not slurm.table["c3"].drained


def test_prolog_never_fails_the_job_when_the_other_run_undid_its_drain(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    _unranked_periodic_drain(slurm)
    read = slurm.out_of_service

    def undone_meanwhile(also: Sequence[str] = ()) -> NodeView:
        slurm.table["c3"] = replace(slurm.table["c3"], state=("MIXED",), reason="")
        return read(also)

    slurm.out_of_service = undone_meanwhile  # type: ignore[method-assign]
    break_gpu(tmp)
    assert entry.prolog(env) == 0 and not slurm.table["c3"].drained


def test_prolog_on_an_operators_drain_lets_it_be_and_waits_for_nothing(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    slurm.table["c3"] = replace(slurm.table["c3"], state=("MIXED", "DRAIN"), reason="maint",
                                reason_set_by="root")
    slept: list[float] = []
    break_gpu(tmp)
    assert entry.prolog(replace(env, sleep=slept.append)) == 0
    assert slept == [] and slurm.table["c3"].reason == "maint"


def test_prolog_fails_the_job_only_on_the_drain_still_there_after_its_makers_decision(node_env) -> None:  # type: ignore[no-untyped-def]
    # The periodic check's drain ranks within the cap as the prolog sees it, but that run
    # decides later on a view that changed (a restamp) and undoes it: the job then runs.
    env, slurm, tmp = node_env
    raced = RacedSlurm(slurm.table)
    naps: list[float] = []

    def sleep(s: float) -> None:
        naps.append(s)
        if len(naps) == 2:  # the prolog waits out the other run's decision
            raced.table["c3"] = replace(raced.table["c3"], state=("IDLE",), reason="")

    break_gpu(tmp)
    assert entry.prolog(replace(env, client=raced, sleep=sleep)) == 0
    assert len(naps) == 2 and not raced.table["c3"].drained


def test_periodic_resumes_its_drain_after_two_passes(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    break_gpu(tmp)
    entry.periodic(env)
    assert slurm.log == ["drain c3"]
    (tmp / "gpus.json").write_text(healthy_fake(8))
    entry.periodic(env)
    assert "DRAIN" in slurm.table["c3"].state
    entry.periodic(env)
    assert slurm.log == ["drain c3", "resume c3"]


def test_epilog_checks_after_a_failed_job_and_always_exits_0(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    entry.periodic(env)  # stored verdict: OK
    assert entry.epilog(env) == 0 and slurm.log == []
    break_gpu(tmp)
    failed = replace(env, environ={**env.environ, "SLURM_JOB_EXIT_CODE": "256"})
    assert entry.epilog(failed) == 0
    assert slurm.log == ["drain c3"]


def test_manual_check_stores_and_drains_nothing(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    break_gpu(tmp)
    v = entry.check(env)
    assert v.status == Status.CRITICAL and v.status.exit_code == 2
    assert slurm.log == [] and not (tmp / "state" / "verdict.json").exists()


def test_malformed_job_gpus_means_all_gpus() -> None:
    assert entry.job_gpus({"SLURM_JOB_GPUS": "0,x"}) is None
    assert entry.job_gpus({"SLURM_JOB_GPUS": "2,5"}) == {2, 5}


def test_bad_node_names_from_the_environment_are_refused(node_env) -> None:  # type: ignore[no-untyped-def]
    env, _, _ = node_env
    env = replace(env, environ={"SLURMD_NODENAME": "../../etc"})
    with pytest.raises(Exception, match="not a valid node name"):
        _ = env.node


def test_the_prolog_import_path_stays_small() -> None:
    code = ("import sys; import gpuwarden.cli, gpuwarden.hooks.entry; "
            "heavy = ('boto3', 'docker', 'jinja2', 'pynvml', 'gpuwarden.lemon.scoring', "
            "'gpuwarden.accounting.history', 'gpuwarden.fleet', 'prometheus_client'); "
            "bad = [m for m in heavy if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_job_id_from_the_environment_is_sanitised() -> None:
    assert entry.job_id({"SLURM_JOB_ID": "1234"}) == "1234"
    assert entry.job_id({"SLURM_JOB_ID": "12\n; rm -rf /"}) == "?"
    assert entry.job_id({}) == "?"


def lost_job(node: str, state: tuple[str, ...] = ("COMPLETED",)) -> Job:
    note = comment([Lost(1, node, "no heartbeat for 6.0 s")])
    return Job(7, "train", "alice", state, "", "gpu", "c1,c3,c5", 3, 0, 0, "", note)


def test_a_node_the_launcher_lost_gets_every_check_and_drains_on_their_evidence(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    entry.periodic(env)  # a fresh OK verdict: a job that exits 0 alone would not be looked at
    break_gpu(tmp)
    slurm.job_table[7] = lost_job("c3")
    assert entry.epilog(env) == 0
    assert slurm.log == ["drain c3"]
    assert slurm.table["c3"].reason == \
        "gpuwarden: epilog: 1 uncorrectable ECC errors on GPU 5 [health]"
    assert slurm.job_reads == 1  # one RPC shared with tier 0's cleanup


def test_the_launchers_note_alone_never_drains_a_healthy_node(node_env, caplog) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node_env
    entry.periodic(env)
    slurm.job_table[7] = lost_job("c3")
    with caplog.at_level("WARNING"):
        assert entry.epilog(env) == 0
    assert slurm.log == []
    assert "launcher lost c3 (rank 1: no heartbeat for 6.0 s): running every check" in caplog.text
    assert "passed every check" in caplog.text and "left in service" in caplog.text


def test_a_note_naming_another_node_or_a_users_comment_changes_nothing(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    entry.periodic(env)
    break_gpu(tmp)  # found only if the epilog looks: it must not, for these notes
    for note_job in (lost_job("c5"),
                     replace(lost_job("c3"), comment="lost c3 (rank 1: trust me)"),
                     replace(lost_job("c3"), comment="")):
        slurm.job_table[7] = note_job
        assert entry.epilog(env) == 0
    assert slurm.log == []


def test_an_unreadable_job_falls_back_to_the_usual_epilog(node_env, caplog) -> None:  # type: ignore[no-untyped-def]
    env, slurm, _ = node_env
    entry.periodic(env)  # no job 7 in the fake: scontrol fails
    with caplog.at_level("WARNING"):
        assert entry.epilog(env) == 0
    assert slurm.log == [] and "cannot read the job" in caplog.text


def test_a_job_read_that_breaks_never_stops_the_epilogs_checks(node_env) -> None:  # type: ignore[no-untyped-def]
    """Whatever goes wrong reading the job (here not a Slurm error at all), the epilog still
    checks after a failed job and drains on evidence, and says it could not read the job."""
    env, slurm, tmp = node_env
    entry.periodic(env)

    def broken(job_id: int) -> Job:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    slurm.job = broken  # type: ignore[method-assign]
    break_gpu(tmp)
    failed = replace(env, environ={**env.environ, "SLURM_JOB_EXIT_CODE": "256"})
    assert entry.epilog(failed) == 0
    assert slurm.log == ["drain c3"]
    assert "slurm" in failed.problems and "UnicodeDecodeError" in failed.problems["slurm"]


def test_a_job_slurm_will_not_requeue_is_still_failed_and_left_to_slurm(node_env, caplog) -> None:  # type: ignore[no-untyped-def]
    from gpuwarden.core.errors import SlurmError

    env, slurm, tmp = node_env
    break_gpu(tmp)

    def refused(job_id: int) -> None:
        raise SlurmError(f"`scontrol requeue {job_id}` failed (exit 1): Requeue of JobId is "
                         "disabled")

    slurm.requeue = refused
    assert entry.prolog(env) == 1  # Slurm cancels it once the prolog exits, as before
    assert slurm.log == ["drain c3"]
    assert "not requeued by the prolog" in caplog.text


def test_no_requeue_without_a_plain_job_id(node_env) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node_env
    break_gpu(tmp)
    assert entry.prolog(replace(env, environ={**env.environ, "SLURM_JOB_ID": "7;rm"})) == 1
    assert slurm.log == ["drain c3"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root (chown)")
def test_the_prolog_writes_the_jobs_key_and_the_epilog_removes_it(node_env) -> None:  # type: ignore[no-untyped-def]
    env, _, tmp = node_env
    os.chmod(tmp, 0o755)
    (tmp / "etc").mkdir(mode=0o755)
    (tmp / "etc" / "ckpt.key").write_text("k1 " + "ab" * 32 + "\n")
    os.chmod(tmp / "etc" / "ckpt.key", 0o600)
    ckpt = replace(env.config.ckpt, key_file=str(tmp / "etc" / "ckpt.key"),
                   job_key_dir=str(tmp / "run" / "gpuwarden-ckpt"))
    env = replace(env, config=replace(env.config, ckpt=ckpt),
                  environ={**env.environ, "SLURM_JOB_UID": "23456"})
    key = tmp / "run" / "gpuwarden-ckpt" / "job-7.key"
    assert entry.prolog(env) == 0
    assert key.stat().st_uid == 23456 and key.read_text().startswith("k1 ")
    assert entry.epilog(env) == 0
    assert not key.exists()


def test_without_key_file_the_hooks_write_no_key(node_env) -> None:  # type: ignore[no-untyped-def]
    env, _, tmp = node_env
    env = replace(env, config=replace(env.config, ckpt=replace(
        env.config.ckpt, job_key_dir=str(tmp / "run" / "gpuwarden-ckpt"))))
    assert entry.prolog(env) == 0 and entry.epilog(env) == 0
    assert not (tmp / "run").exists()
