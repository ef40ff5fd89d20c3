"""Issue 16: ETTR's lost work and restart cost were modelled for every failure (τ/2 and u0),
though the jobs that checkpoint with gpuwarden record when they restored and from which save.
A failure followed by its job's restore is now measured; the rest stay modelled. Figures on
test_report_numbers' history worked out by hand."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.accounting.attribution import attribute, health_drains, node_failures
from gpuwarden.accounting.history import History
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
from gpuwarden.ckpt.restorelog import RestoreRecord, parse, per_tier, read_records
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report import restarts
from gpuwarden.report.build import Report, build, failed_runs
from gpuwarden.report.collect import RunTally
from gpuwarden.report.ettr import EttrSection
from gpuwarden.report.render import render
from gpuwarden.report.tradeoffs import RestoreTimes
from gpuwarden.slurm.models import AcctJob
from tests.unit.test_report_numbers import EVENTS, JOBS, LEAVES, OPTS, T0, H, job

UIDS = {"alice": 1000, "mallory": 2000}
END2 = T0 + 5 * H  # job 2's NODE_FAIL run (16 GPUs, alice) ends here
END6 = T0 + 86_400 + 3 * H  # job 6's FAILED gang run (16 GPUs, alice) ends here
# Both requeued: their next runs, an hour each, start 600 s and 30 s after the failures.
RERUNS = [job(2, "COMPLETED", "a", "n[6-7]", 16, END2 + 600, 1),
          job(6, "COMPLETED", "b", "n[6-7]", 16, END6 + 30, 1)]


def history() -> History:
    runs = JOBS + RERUNS
    tally = RunTally(LEAVES, watch=frozenset({2, 6, 7}))
    tally.add(runs)
    att = attribute(runs, health_drains(EVENTS), failures=node_failures(EVENTS))
    return History(att, len(runs), tuple(EVENTS), tally)


def _rec(job: str, rank: int, at: float, seconds: float, saved_at: float | None,
         owner: int, run: str = "r1-s0") -> RestoreRecord:
    return RestoreRecord(job, rank, run, 7, "shared", 1 << 30, seconds, at, saved_at, owner)


RECORDS = [
    # Job 2 restored 1,200 s after its failure (the last rank, in its next run), from a step
    # saved 900 s before it: 900 s of work lost, a 1,200 s restart (600 s between the runs).
    _rec("job-2", 0, END2 + 1100, 30.0, END2 - 900, 1000),
    _rec("job-2", 1, END2 + 1200, 20.0, END2 - 900, 1000),
    # Job 6 failed too (alice's), but mallory's directory speaks for it: not counted.
    _rec("job-6", 0, END6 + 60, 5.0, END6 - 1, 2000),
    # Job 7 was preempted, not blamed: no failure explains the restore.
    _rec("job-7", 0, T0 + 86_400 + H + 60, 5.0, T0 + 86_400, 1000),
]


def _report(records: list[RestoreRecord]) -> Report:
    return build(history(), OPTS, ScoreConfig(),
                 restores=RestoreTimes("/fsx", per_tier(records), 0, records),
                 uid_of=UIDS.get)


def _card(e: EttrSection, rep: Report) -> dict[str, object]:
    t = next(t for t in rep.tradeoffs if t.key == "checkpoint_vs_redundancy")
    return {f.label: f.value for f in t.figures}


def test_a_failure_its_job_restored_after_is_measured_not_modelled() -> None:
    rep = _report(RECORDS)
    e = rep.ettr
    sixteen = e.rows[1]
    # 16 GPUs: H = 10 (the reruns add 2 h), F = 2; tau = 1 h, C = 0.01 h, u0 = 0.5 h.
    # Failure 2 measured: 900 s since the save and 600 s restoring inside the next run are
    # lost (1,500 s), the 600 s between the runs is wall time on top of H; failure 6
    # modelled: min(0.5, 3) lost, 0.5 h restart.
    # (10 - 1500/3600 - 0.5 - 0.1) / (10 + 600/3600 + 0.5) = 8.98333 / 10.66667 = 0.8422.
    assert sixteen.ettr_now == 0.8422 and sixteen.measured == 1
    # At Daly (M = 5 h) the work since the save is modelled again (another tau); the restarts
    # and the 600 s restoring inside the next run are kept.
    x = 0.01 / (2 * 5)
    tau = math.sqrt(2 * 0.01 * 5) * (1 + math.sqrt(x) / 3 + x / 9) - 0.01
    want = (10 - tau - 600 / 3600 - 10 * 0.01 / tau) / (10 + 600 / 3600 + 0.5)
    assert sixteen.ettr_daly == pytest.approx(want, abs=5e-5)
    card = _card(e, rep)
    assert card["failures measured from the jobs' restore records"] == 1
    assert card["work lost per measured failure (median)"] == 900
    assert card["restart per measured failure, failure to restored (median)"] == 1200
    assert (e.restores_not_owner, e.restores_unexplained) == (1, 1)
    t = next(t for t in rep.tradeoffs if t.key == "checkpoint_vs_redundancy")
    assert any("1 job restores left out" in m for m in t.missing)


def test_without_records_every_failure_is_modelled_as_before() -> None:
    e = _report([]).ettr
    # (10 - 2 * 0.5 - 0.1) / (10 + 2 * 0.5) = 8.9 / 11 = 0.8091.
    assert e.rows[1].ettr_now == 0.8091 and e.measured_failures == 0
    assert e.measured_lost_median_s is None and e.measured_restart_median_s is None


def test_only_the_jobs_user_speaks_for_it() -> None:
    # The same job-2 records in a directory another user owns count for nothing.
    forged = [_rec("job-2", 0, END2 + 660, 1.0, END2, 2000)]
    e = _report(forged).ettr
    assert e.rows[1].ettr_now == 0.8091 and e.restores_not_owner == 1
    # Nor where the job's user does not resolve on the admin host.
    e = build(history(), OPTS, ScoreConfig(),
              restores=RestoreTimes("/fsx", [], 0, forged), uid_of=lambda u: None).ettr
    assert e.measured_failures == 0


def test_a_records_times_are_bounded_by_accounting() -> None:
    # A step saved before the failed run started (no save in it): the whole 5 h run is lost,
    # not the time back to that save. A save stamped just after the failure (clock skew)
    # loses nothing; one well after it is a later run's step: not this failure's restore.
    early = [_rec("job-2", 0, END2 + 700, 1.0, END2 - 9 * H, 1000)]
    e = _report(early).ettr
    assert e.measured_lost_median_s == 5 * H
    late = [_rec("job-2", 0, END2 + 700, 1.0, END2 + 10, 1000)]
    assert _report(late).ettr.measured_lost_median_s == 0
    later = _report([_rec("job-2", 0, END2 + 700, 1.0, END2 + 3000, 1000)]).ettr
    assert later.measured_failures == 0 and later.restores_unexplained == 1
    # A restore that ended outside every run of its job (a time the user made up: after the
    # rerun ended, or before it began) is not placed: it measures nothing.
    for at in (END2 + 600 + 2 * H, END2 + 300 - 61):
        e = _report([_rec("job-2", 0, at, 1.0, END2 - 60, 1000)]).ettr
        assert e.measured_failures == 0 and e.restores_unexplained == 1, at
    # A record from before saved_at was written: its restart counts, its lost work modelled.
    old = [_rec("job-2", 0, END2 + 700, 1.0, None, 1000)]
    e = _report(old).ettr
    assert e.measured_failures == 1 and e.measured_lost_median_s is None
    assert e.measured_restart_median_s == 700


def test_one_restore_per_failure() -> None:
    # Two restores after job 2's one failure (a later requeue without a failure): the first
    # measures it, the second is unexplained.
    twice = [_rec("job-2", 0, END2 + 700, 1.0, END2 - 60, 1000),
             _rec("job-2", 0, END2 + 1800, 1.0, END2 - 60, 1000, run="r2-s0")]
    e = _report(twice).ettr
    assert e.measured_failures == 1 and e.measured_restart_median_s == 700
    assert e.restores_unexplained == 1


def test_a_rank_records_when_its_restored_step_was_saved(tmp_path: Path) -> None:
    cfg = CkptConfig(memory_root=str(tmp_path / "m"), shared_root=str(tmp_path / "s"),
                     peer_replicas=0)
    ck = JobCheckpointer(cfg, JobEnv("42", 0, 1, 0, "0", "n1"))
    saved = ck.save(5, {"w": np.arange(1 << 10, dtype=np.float32)})
    assert ck.finish(5, timeout=60)
    again = JobCheckpointer(cfg, JobEnv("42", 0, 1, 1, "0", "n1"))
    got = again.restore()
    again.finish(None)
    assert got is not None
    [r], skipped = read_records(str(tmp_path / "s"))
    assert skipped == [] and r.saved_at == saved.created_at
    assert r.owner == os.getuid() and r.restarts == 1 and r.job_id == 42


def test_a_record_from_before_saved_at_still_reads() -> None:
    doc = {"bytes": 1, "job": "job-3", "rank": 0, "run": "r1-s0", "seconds": 1.0,
           "step": 2, "tier": "peer", "at": 5.0}
    rec = parse(json.dumps(doc).encode(), "job-3", "restore-r1-s0.rank-0")
    assert rec.saved_at is None
    bad = {**doc, "saved_at": "soon"}
    try:
        parse(json.dumps(bad).encode(), "job-3", "restore-r1-s0.rank-0")
    except ValueError as exc:
        assert "saved_at" in str(exc)
    else:
        raise AssertionError("a saved_at that is not a time was taken")


def _requeued_history() -> History:
    # As Slurm 24.11+ accounts a requeue: the next run carries its restart count.
    runs = JOBS + [replace(j, restart_count=1) for j in RERUNS]
    tally = RunTally(LEAVES, watch=frozenset({2, 6, 7}))
    tally.add(runs)
    att = attribute(runs, health_drains(EVENTS), failures=node_failures(EVENTS))
    return History(att, len(runs), tuple(EVENTS), tally)


def test_a_requeued_failure_without_restore_records_restarts_in_its_measured_wait() -> None:
    e = build(_requeued_history(), OPTS, ScoreConfig(), uid_of=UIDS.get).ettr
    sixteen = e.rows[1]
    # Both 16-GPU failures were requeued (600 s and 30 s until their next runs): those waits
    # replace u0 = 0.5 h each; the lost work stays modelled (min(0.5, t) each), and each
    # next run loses r0 = 300 s restoring, which accounting does not show.
    # (10 - 2 * 0.5 - 600 / 3600 - 0.1) / (10 + 630 / 3600) = 8.7333 / 10.175 = 0.8583.
    assert sixteen.ettr_now == 0.8583 and sixteen.requeue_measured == 2
    assert (e.measured_failures, e.requeue_measured, e.requeue_wait_median_s) == (0, 2, 315)
    # The spares' payoff weighs a requeue at what these cost (315 s waiting and r0 = 300 s
    # restoring, not u0's 1,800 s) less the swap s = 180 s.
    assert sixteen.requeue_lost_gpu_h == pytest.approx(2 * (615 - 180) / 3600 * 16, abs=0.01)


def test_a_restore_record_still_measures_more_than_the_requeue_wait() -> None:
    rep = build(_requeued_history(), OPTS, ScoreConfig(),
                restores=RestoreTimes("/fsx", per_tier(RECORDS), 0, RECORDS), uid_of=UIDS.get)
    e = rep.ettr
    # Failure 2 from its records (1,500 s lost, 600 s between the runs), failure 6 (mallory's
    # records do not count for it) from its 30 s requeue wait, and r0 = 300 s restoring:
    # (10 - 1500/3600 - 0.5 - 300/3600 - 0.1) / (10 + 630/3600) = 8.9 / 10.175 = 0.8747.
    assert e.rows[1].ettr_now == 0.8747
    assert (e.measured_failures, e.requeue_measured, e.requeue_wait_median_s) == (1, 1, 30)
    card = _card(e, rep)
    assert card["failures whose requeue wait accounting measured (no restore record)"] == 1


def test_accounting_without_gpu_tres_says_how_to_record_gpus() -> None:
    # Slurm's default AccountingStorageTRES has no gres/gpu: every run shows no GPUs, and the
    # page was all empty GPU figures with no word why.
    runs = [replace(j, gpus=0) for j in JOBS]
    tally = RunTally(LEAVES)
    tally.add(runs)
    att = attribute(runs, health_drains(EVENTS), failures=node_failures(EVENTS))
    rep = build(History(att, len(runs), tuple(EVENTS), tally), OPTS, ScoreConfig())
    assert any("AccountingStorageTRES=gres/gpu" in w for w in rep.warnings)
    assert "AccountingStorageTRES=gres/gpu" in render(rep)
    assert build(history(), OPTS, ScoreConfig()).warnings == []


DAY = 86_400


def _with(runs: list[AcctJob]) -> History:
    tally = RunTally(LEAVES, watch=frozenset({2, 6, 7}))
    tally.add(runs)
    att = attribute(runs, health_drains(EVENTS), failures=node_failures(EVENTS))
    return History(att, len(runs), tuple(EVENTS), tally)


def test_a_next_run_days_later_is_a_hold_not_a_restart() -> None:
    # Job 2 was not requeued by Slurm; its user requeued it by hand (or released a hold) 30
    # days later: that is not what the failure cost, and one user must not sink the figure.
    later = [replace(job(2, "COMPLETED", "a", "n[6-7]", 16, END2 + 30 * DAY, 1),
                     restart_count=1)]
    rep = build(_with(JOBS + later), OPTS, ScoreConfig(), uid_of=UIDS.get)
    e = rep.ettr
    assert e.requeue_measured == 0 and e.requeue_too_long == 1
    assert e.rows[1].ettr_now > 0.7
    t = next(t for t in rep.tradeoffs if t.key == "checkpoint_vs_redundancy")
    assert any("more than a day later" in m for m in t.missing)


def test_a_job_id_given_out_again_to_another_user_is_not_the_requeue() -> None:
    bob = [replace(job(2, "COMPLETED", "a", "n[6-7]", 16, END2 + 3600, 1), user="bob",
                   restart_count=1)]
    assert build(_with(JOBS + bob), OPTS, ScoreConfig()).ettr.requeue_measured == 0


def test_a_requeue_that_failed_in_its_first_second_waits_for_the_run_after_it() -> None:
    # Job 9: NODE_FAIL, requeued; the requeue (restart 1) BOOT_FAILs in the second it starts
    # (start == end in accounting); requeued again (restart 2) 900 s later.
    x = T0 + 2 * DAY
    runs = [
        *JOBS,
        job(9, "NODE_FAIL", "a", "n[6-7]", 16, x - 2 * H, 2),
        replace(job(9, "BOOT_FAIL", "a", "n[6-7]", 16, x + 600, 0), restart_count=1),
        replace(job(9, "COMPLETED", "a", "n[6-7]", 16, x + 1500, 1), restart_count=2),
    ]
    h = _with(runs)
    assert isinstance(h.collected, RunTally)
    fr = [f for f, _ in failed_runs(h.collected, h.attribution)]
    m = restarts.match((), fr, h.collected.watched, UIDS.get, h.collected.requeued)
    assert {f.end: m.requeue_wait.get(f.key) for f in fr if f.job_id == 9} == \
        {x: 600.0, x + 600: 900.0}


def test_the_spares_payoff_counts_the_measured_restore_a_spare_would_not_need() -> None:
    runs = JOBS + [replace(j, restart_count=1) for j in RERUNS]
    rep = build(_with(runs), OPTS, ScoreConfig(), uid_of=UIDS.get,
                restores=RestoreTimes("/fsx", per_tier(RECORDS), 0, RECORDS))
    # Job 2: failure to restored 1,200 s (600 s between the runs); job 6: a 30 s wait and
    # r0 = 300 s restoring; s = 180.
    assert rep.ettr.rows[1].requeue_lost_gpu_h == \
        pytest.approx(((1200 + 330) / 2 - 180) / 3600 * 2 * 16, abs=0.01)
