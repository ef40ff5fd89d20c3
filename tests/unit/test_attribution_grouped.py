"""The fleet-scale read (issue 16: 10M records) tallies most records by node list and by cell
at once, reading each field from columns (`slurm.acctcols`). It must give exactly what judging
every record on its own gives: the lemon attribution, the report's tally, and each column
what the record's property says."""

from __future__ import annotations

import io
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting.attribution import (
    Attribution,
    attribute_runs,
    by_node,
    health_drains,
    lemon_clears,
    node_failures,
)
from gpuwarden.accounting.columns import Columns
from gpuwarden.report.collect import Blamable, RunTally
from gpuwarden.slurm.models import AcctJob, NodeEvent

T0 = 1_767_225_600
STATES = ("COMPLETED", "FAILED", "NODE_FAIL", "BOOT_FAIL", "REQUEUED", "CANCELLED", "TIMEOUT",
          "PENDING", "PREEMPTED", "")
NODE_LISTS = ("n1", "n2", "n[1-4]", "n[3-4]", "n[01-02]", "n[1,3]", "n[1-2],m1", "m[1-2]x",
              "", "None assigned", "(null)", "n[2-1]", "n[1-2]-[3-4]", "n1,n2")


@st.composite
def records(draw: st.DrawFn) -> AcctJob:
    start = draw(st.one_of(st.none(), st.integers(T0, T0 + 3 * 86_400)))
    # Lengths around the edges: ended before it started, 0 s (counted as 1), across days.
    length = draw(st.one_of(st.none(), st.sampled_from((-5, 0, 1, 59, 3600, 86_400)),
                            st.integers(0, 2 * 86_400)))
    end = None if length is None else (start or T0) + length
    return AcctJob(draw(st.integers(1, 40)), "j", draw(st.sampled_from(("alice", "bob", ""))),
                   draw(st.sampled_from(STATES)), "", draw(st.sampled_from(("gpu", "cpu", ""))),
                   draw(st.sampled_from(NODE_LISTS)), 1, draw(st.sampled_from((0, 1, 8, 16, -1))),
                   draw(st.sampled_from((0, 1, None))), None,
                   draw(st.one_of(st.none(), st.integers(T0 - 3600, T0))), start, end,
                   draw(st.sampled_from((None, 0, 1, 2))),
                   draw(st.sampled_from(("", "n1", "n2"))),
                   draw(st.sampled_from(("", "sbatch -w n1 x.sh", "sbatch x.sh"))))


@st.composite
def events(draw: st.DrawFn) -> list[NodeEvent]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        at = T0 + draw(st.integers(0, 4 * 86_400))
        reason = draw(st.sampled_from((
            "gpuwarden: xid 79 [health]", "Not responding", "gpuwarden: lemon: score 9.1",
            "gpuwarden: lemon: score 7.0", "maintenance")))
        out.append(NodeEvent("", draw(st.sampled_from(("n1", "n2", "n3", "m1", "n01"))),
                             _iso(at), _iso(at + 600), "DRAIN", reason, "root"))
    return out


def _iso(at: int) -> str:
    from datetime import UTC, datetime
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def test_runs_on_a_repaired_lemon_before_its_repair_count_for_no_node_grouped_or_not() -> None:
    """Rule 7 in the grouped path: a node list with a cleared node is judged run by run."""
    evs = [NodeEvent("", "n1", _iso(T0), _iso(T0 + 7200), "DRAIN", "gpuwarden: lemon: 9.1",
                     "root")]
    jobs = [AcctJob(i, "j", "a", "COMPLETED", "", "gpu", nodes, 1, 8, 0, None, None, start,
                    start + 60, 0) for i, (nodes, start) in enumerate(
                        [("n1", T0), ("n1", T0 + 9000), ("n[1-2]", T0), ("n2", T0)])]
    for grouped in (True, False):
        att = attribute_runs(jobs, {}, 3600.0, lemon_clears(evs), {}, grouped=grouped)
        assert {n: e.jobs for n, e in att.exposure.items() if e.jobs} == {"n1": 1, "n2": 2}
        assert att.runs_by_size == {1: 2, 2: 1}  # node-runs, the cleared node left out


def summary(att: Attribution) -> tuple[Any, ...]:
    inc = att.incidence
    return (att.blames, {n: (e.jobs, round(e.hours, 6), dict(e.by_size))
                         for n, e in att.exposure.items() if e.jobs},
            dict(att.skipped), dict(att.runs_by_size), dict(att.pinned_by_size),
            dict(att.spread_by_size), dict(att.gpu_runs), dict(att.gpu_failures),
            {g: round(h, 6) for g, h in att.gpu_hours.items()},
            {g: round(h, 6) for g, h in att.class_gpu_hours.items()},
            att.first_start, att.first_end, att.last_end, att.pending,
            {s: round(h, 6) for s, h in inc.bucket_hours.items()}, list(inc.node),
            list(inc.flags), list(inc.hours))


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), max_size=40), events())
def test_grouped_attribution_is_the_same_as_judging_each_record(jobs: list[AcctJob],
                                                                evs: list[NodeEvent]) -> None:
    drains, failures = by_node(health_drains(evs)), by_node(node_failures(evs))
    clears = lemon_clears(evs)
    one = attribute_runs(jobs, drains, 3600.0, clears, failures, grouped=False)
    grouped = attribute_runs(jobs, drains, 3600.0, clears, failures)
    assert summary(grouped) == summary(one)


def tally_summary(t: RunTally) -> tuple[Any, ...]:
    # A job's runs in any order: report.restarts reads them sorted, or the earliest.
    return (dict(t.cells), t.never_ran, t.cpu_runs, dict(t.gpu_seconds), t.blamable,
            {j: sorted(v) for j, v in t.requeued.items()},
            {j: sorted(v) for j, v in t.watched.items()}, t.watched_users,
            dict(t.gang_runs), dict(t.gang_wait_s), dict(t.gang_waited))


@settings(max_examples=300, deadline=None)
@given(st.lists(records(), max_size=40), events())
def test_grouped_report_tally_is_the_same_as_tallying_each_record(jobs: list[AcctJob],
                                                                 evs: list[NodeEvent]) -> None:
    leaves = {"n1": "s1", "n2": "s1", "n3": "s2", "n4": "s2", "m1": "s3", "m2": "s3"}
    for leaf_of in (None, leaves):
        one = RunTally(leaf_of, Blamable.of(evs), frozenset({1, 2, 3}))
        one.add(jobs, grouped=False)
        grouped = RunTally(leaf_of, Blamable.of(evs), frozenset({1, 2, 3}))
        grouped.add(jobs)
        assert tally_summary(grouped) == tally_summary(one)


def _wrapped(v: int) -> dict[str, Any]:
    return {"set": True, "infinite": False, "number": v}


ODD = [  # field values the columns must read exactly as the properties do
    {"job_id": 1, "nodes": "n[1-2]", "state": {"current": ["COMPLETED"]},
     "time": {"start": T0, "end": T0 + 60}, "restart_cnt": 2,
     "tres": {"allocated": [{"type": "gres", "name": "gpu", "count": 8},
                            {"type": "gres", "name": "gpu", "count": 4}]}},
    {"job_id": _wrapped(2), "state": {"current": "FAILED,REQUEUED"},
     "time": {"start": _wrapped(T0), "end": 0xFFFFFFFFFFFFFFFE}, "restart_cnt": _wrapped(1)},
    {"job_id": 3, "nodes": None, "state": {"current": ["REQUEUED", "FAILED"]},
     "time": {"start": 0, "end": -5}, "restart_cnt": -1, "partition": "p",
     "tres": {"allocated": [{"type": "gres", "name": "gpu",
                             "count": {"set": False, "infinite": False, "number": 9}},
                            {"type": "gres", "name": "gpu", "count": -2}]}},
    {"job_id": 4, "state": {"current": []}, "time": None, "tres": None,
     "restart_cnt": 0xFFFFFFFE},
    {"job_id": 5, "state": None, "time": {"start": None, "end": _wrapped(T0 + 1)},
     "tres": {"allocated": [{"type": "gres", "name": "gpu"}, {"type": "cpu", "count": 4}]}},
    {"job_id": 6, "nodes": "c1", "state": {"current": [""]}, "partition": "gpu",
     "time": {"start": 0xFFFFFFFE, "end": T0}},
]


def test_each_column_reads_a_record_exactly_as_its_property() -> None:
    text = json.dumps({"jobs": ODD * 3})  # the first and last go the standard library's way
    stream = acctstream.AcctStream(acctstream.text_reader(io.BytesIO(text.encode())), "t")
    recs = [r for r in stream.runs() if not isinstance(r, Exception)]
    assert len(recs) == len(ODD) * 3 and any(not isinstance(r, AcctJob) for r in recs)
    cols = Columns(recs)
    assert cols.nodes == [r.nodes for r in recs]
    assert cols.states == [r.state for r in recs]
    assert cols.starts == [r.start_time or 0 for r in recs]
    assert cols.ends == [r.end_time or 0 for r in recs]
    assert cols.gpus == [r.gpus for r in recs]
    assert cols.restarts == [r.restart_count or 0 for r in recs]
    assert cols.job_ids == [r.job_id for r in recs]
    want_parts = [r.partition if isinstance(r, AcctJob) else (r.partition_ or "")  # type: ignore[attr-defined]
                  for r in recs]
    assert cols.partitions == want_parts
    later = cols.ended_in(T0, T0 + 61)
    assert [r.job_id for r in later.records] == [
        r.job_id for r in recs if r.end_time is not None and T0 <= r.end_time < T0 + 61]
    assert later.ends == [r.end_time for r in later.records]


def test_a_node_list_too_long_to_expand_beside_a_repaired_lemon_is_skipped_not_a_crash() -> None:
    # Each range under the expansion cap, the list over it: the grouped path looked for the
    # repaired node in it unguarded, and the read died with a traceback.
    evs = [NodeEvent("", "x1", _iso(T0), _iso(T0 + 60), "DRAIN", "gpuwarden: lemon: 9.1",
                     "root")]
    jobs = [AcctJob(1, "j", "a", "COMPLETED", "", "gpu", "n[0-500000,0-500000]", 1, 8, 0, None,
                    None, T0, T0 + 60, 0)]
    for grouped in (True, False):
        att = attribute_runs(jobs, {}, 3600.0, lemon_clears(evs), {}, grouped=grouped)
        assert att.skipped == {"unreadable node list": 1}


def _as_sacct(r: AcctJob) -> dict[str, Any]:
    gpus = [{"type": "gres", "name": "gpu", "count": r.gpus}] if r.gpus > 0 else []
    return {"job_id": r.job_id, "name": r.name, "user": r.user, "nodes": r.nodes,
            "partition": r.partition, "allocation_nodes": r.num_nodes,
            "state": {"current": [r.state] if r.state else [], "reason": "None"},
            "time": {"submission": r.submit_time or 0, "start": r.start_time or 0,
                     "end": r.end_time or 0},
            "restart_cnt": r.restart_count,
            "tres": {"allocated": [*gpus, {"type": "cpu", "count": 4}]},
            "failed_node": r.failed_node, "submit_line": r.submit_line,
            "exit_code": {"status": ["SUCCESS"],
                          "return_code": {"set": True, "infinite": False, "number": 0}}}


@settings(max_examples=150, deadline=None)
@given(st.lists(records(), max_size=60), events(), st.integers(1, 25))
def test_a_file_read_in_batches_attributes_as_judging_each_decoded_record(
        jobs: list[AcctJob], evs: list[NodeEvent], batch: int) -> None:
    """What the reader does to a file (the fast decoder's records, batches, the exposure
    spread once per file) against one-by-one judging of the same decoded records."""
    from gpuwarden.accounting import history

    text = json.dumps({"jobs": [_as_sacct(r) for r in jobs]})
    stream = acctstream.AcctStream(acctstream.text_reader(io.BytesIO(text.encode())), "t")
    recs = [r for b in stream.run_batches() for r in b]
    assert len(recs) == len(jobs)
    known = history._Known.of(evs, 3600.0)
    one = attribute_runs(recs, known.drains, 3600.0, known.clears, known.failures,
                         grouped=False)
    old, history.BATCH = history.BATCH, batch
    try:
        att, n = history._count(Attribution(), [recs[i:i + 7] for i in range(0, len(recs), 7)],
                                "", known)
    finally:
        history.BATCH = old
    assert n == len(recs) and summary(att) == summary(one)
