"""The report's cards make a year's million objects without the frozen dataclasses' __init__
and sum the ETTR terms from columns: the objects and figures are those the plain way gives."""

from __future__ import annotations

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.blames import Blame
from gpuwarden.report import ettr
from gpuwarden.report.collect import RunTally, run_key
from gpuwarden.report.lemons import Evidence, _evidence
from gpuwarden.report.outcomes import blamed_runs


def test_evidence_made_fast_is_the_dataclass_own() -> None:
    got = _evidence([(1_700_000_000.0, 42, "node failed", 0.33333), (5.5, None, "drain", 1.0)])
    want = [Evidence("2023-11-14T22:13:20Z", 42, "node failed", 0.333),
            Evidence("1970-01-01T00:00:05Z", None, "drain", 1.0)]
    assert got == want
    assert [hash(e) for e in got] == [hash(e) for e in want]
    assert [repr(e) for e in got] == [repr(e) for e in want]


def test_failures_as_columns_read_back_as_given() -> None:
    runs = [ettr.Failure(2.5, None, 0.25, restore_h=0.1, requeue_h=0.25),
            ettr.Failure(1.0, 0.5, 0.2, 0.5, 0.3, None, 0.1), ettr.Failure(3.0)]
    cols = ettr.Columns(runs)
    assert [cols.failure(i) for i in range(3)] == runs
    assert [cols.first(2).failure(i) for i in range(2)] == runs[:2]


def _plain_lost(f: int, tau: float, runs: list[ettr.Failure], measured: bool,
                restores: bool) -> float:
    half = tau / 2
    return sum((r.lost_h if measured and r.lost_h is not None else min(half, r.hours))
               + (r.restore_h if restores else 0.0) for r in runs[:f]) + \
        max(0, f - len(runs[:f])) * half


def test_ettr_sums_are_python_sums_in_order() -> None:
    # Terms whose pairwise (numpy) sum rounds differently from a left-to-right one.
    runs = [ettr.Failure(0.1 * k + 1e-9 * k * k, 0.3 if k % 3 == 0 else None,
                         0.7 if k % 2 else None, None, 0.9 if k % 5 == 0 else None,
                         None, 0.01 * k) for k in range(1, 500)]
    for measured in (False, True):
        for restores in (False, True):
            want = _plain_lost(520, 3.3, runs, measured, restores)
            assert ettr.lost(520, 3.3, runs, measured, restores) == want
            assert ettr.lost(520, 3.3, ettr.Columns(runs), measured, restores) == want
    assert ettr.restart(400, 0.25, runs, True) == sum(
        r.restart_h if r.restart_h is not None else 0.25 for r in runs[:400])
    assert ettr.requeue_cost(499, 0.25, runs) == sum(
        r.shown_restart_h if r.shown_restart_h is not None
        else r.restart_h + r.restore_h if r.restart_h is not None else 0.25
        for r in runs) / 499


def test_a_gang_run_counts_once_in_the_blamed_runs() -> None:
    att = Attribution()
    # A gang run blamed on two nodes, added twice (two batches); a drain without a run.
    for _ in range(2):
        for node in ("n1", "n2"):
            att.blames.append(Blame(node, 0.5, 7, 1000.9, "failed", 2, False, 10.0, 8))
    att.blames.append(Blame("n3", 1.0, None, 2000.0, "health drain: x"))
    att.blames.append(Blame("n4", 1.0, 8, 3000.0, "node failed", 1, True, 20.0, 8))
    tally = RunTally()
    got = [run for run, _ in blamed_runs(tally, att)]
    assert got == [(run_key(7, 1000), 7, 1000, False), (run_key(8, 3000), 8, 3000, True)]
