"""Issue 16: ETTR's lost work and restart cost were modelled for every failure (τ/2 and u0),
though the jobs that checkpoint with gpuwarden record when they restored and from which save.
A failure followed by its job's restore is now measured; the rest stay modelled. Figures on
test_report_numbers' history worked out by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from gpuwarden.ckpt.config import CkptConfig
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
from gpuwarden.ckpt.restorelog import RestoreRecord, parse, per_tier, read_records
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report.build import Report, build
from gpuwarden.report.ettr import EttrSection
from gpuwarden.report.tradeoffs import RestoreTimes
from tests.unit.test_report_numbers import LEAVES, OPTS, T0, H, history

UIDS = {"alice": 1000, "mallory": 2000}
END2 = T0 + 5 * H  # job 2's NODE_FAIL run (16 GPUs, alice) ends here


def _rec(job: str, rank: int, at: float, seconds: float, saved_at: float | None,
         owner: int, run: str = "r1-s0") -> RestoreRecord:
    return RestoreRecord(job, rank, run, 7, "shared", 1 << 30, seconds, at, saved_at, owner)


RECORDS = [
    # Job 2 restored 1,200 s after its failure (the slower rank), from a step saved 900 s
    # before it: 900 s of work lost, a 1,200 s restart.
    _rec("job-2", 0, END2 + 1100, 20.0, END2 - 900, 1000),
    _rec("job-2", 1, END2 + 1200, 30.0, END2 - 900, 1000),
    # Job 6 failed too (alice's), but mallory's directory speaks for it: not counted.
    _rec("job-6", 0, T0 + 86_400 + 3 * H + 60, 5.0, T0 + 86_400 + 3 * H - 1, 2000),
    # Job 7 was preempted, not blamed: no failure explains the restore.
    _rec("job-7", 0, T0 + 86_400 + H + 60, 5.0, T0 + 86_400, 1000),
]


def _report(records: list[RestoreRecord]) -> Report:
    return build(history(LEAVES), OPTS, ScoreConfig(),
                 restores=RestoreTimes("/fsx", per_tier(records), 0, records),
                 uid_of=UIDS.get)


def _card(e: EttrSection, rep: Report) -> dict[str, object]:
    t = next(t for t in rep.tradeoffs if t.key == "checkpoint_vs_redundancy")
    return {f.label: f.value for f in t.figures}


def test_a_failure_its_job_restored_after_is_measured_not_modelled() -> None:
    rep = _report(RECORDS)
    e = rep.ettr
    sixteen = e.rows[1]
    # 16 GPUs: H = 8, F = 2; tau = 1 h, C = 0.01 h, u0 = 0.5 h. Failure 2 measured: 0.25 h
    # lost, 1/3 h restart; failure 6 modelled: min(0.5, 3) lost, 0.5 restart.
    # (8 - 0.25 - 0.5 - 0.08) / (8 + 1/3 + 0.5) = 7.17 / 8.8333 = 0.8117 (modelled: 0.7689).
    assert sixteen.ettr_now == 0.8117 and sixteen.measured == 1
    # At Daly the lost work is modelled again (another tau), the restart kept:
    # (8 - 0.276215 - 0.289629) / 8.8333 = 0.8416.
    assert sixteen.ettr_daly == 0.8416
    card = _card(e, rep)
    assert card["failures measured from the jobs' restore records"] == 1
    assert card["work lost per measured failure (median)"] == 900
    assert card["restart per measured failure, failure to restored (median)"] == 1200
    assert (e.restores_not_owner, e.restores_unexplained) == (1, 1)
    t = next(t for t in rep.tradeoffs if t.key == "checkpoint_vs_redundancy")
    assert any("1 job restores left out" in m for m in t.missing)


def test_without_records_every_failure_is_modelled_as_before() -> None:
    e = _report([]).ettr
    assert e.rows[1].ettr_now == 0.7689 and e.measured_failures == 0
    assert e.measured_lost_median_s is None and e.measured_restart_median_s is None


def test_only_the_jobs_user_speaks_for_it() -> None:
    # The same job-2 records in a directory another user owns count for nothing.
    forged = [_rec("job-2", 0, END2 + 60, 1.0, END2, 2000)]
    e = _report(forged).ettr
    assert e.rows[1].ettr_now == 0.7689 and e.restores_not_owner == 1
    # Nor where the job's user does not resolve on the admin host.
    e = build(history(LEAVES), OPTS, ScoreConfig(),
              restores=RestoreTimes("/fsx", [], 0, forged), uid_of=lambda u: None).ettr
    assert e.measured_failures == 0


def test_lost_work_is_bounded_by_the_failed_run() -> None:
    # A step saved before the failed run started (no save in it): the whole 5 h run is lost,
    # not the time back to that save. A save stamped after the failure loses nothing.
    early = [_rec("job-2", 0, END2 + 600, 1.0, END2 - 9 * H, 1000)]
    e = _report(early).ettr
    assert e.measured_lost_median_s == 5 * H
    late = [_rec("job-2", 0, END2 + 600, 1.0, END2 + 10, 1000)]
    assert _report(late).ettr.measured_lost_median_s == 0
    # A record from before saved_at was written: its restart counts, its lost work modelled.
    old = [_rec("job-2", 0, END2 + 600, 1.0, None, 1000)]
    e = _report(old).ettr
    assert e.measured_failures == 1 and e.measured_lost_median_s is None
    assert e.measured_restart_median_s == 600


def test_one_restore_per_failure() -> None:
    # Two restores after job 2's one failure (a later requeue without a failure): the first
    # measures it, the second is unexplained.
    twice = [_rec("job-2", 0, END2 + 600, 1.0, END2 - 60, 1000),
             _rec("job-2", 0, END2 + 7200, 1.0, END2 + 3000, 1000, run="r2-s0")]
    e = _report(twice).ettr
    assert e.measured_failures == 1 and e.measured_restart_median_s == 600
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
