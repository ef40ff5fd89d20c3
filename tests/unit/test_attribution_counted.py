"""The accounting store's read (`store.scan.attribute`): exposure on columns for plain and
failed runs alike, failed runs judged by node list (`accounting.counted`). It must give exactly
what judging every record on its own gives (`attribute_runs(..., grouped=False)`), every rule
included: gang failures (3), node failures with and without sacct's failed node (1), requeues
with and without an event (2), one-node failures with and without a health drain (4), lone
drains (5), repaired lemons (7) and events two runs could claim (8)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.attribution import (
    Attribution,
    Blame,
    add_lone_drains,
    attribute_runs,
    by_node,
    health_drains,
    lemon_clears,
    node_failures,
    spread_exposure,
)
from gpuwarden.accounting.blames import Blames
from gpuwarden.accounting.counted import _names, countable
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.store import rollup, scan, schema
from gpuwarden.slurm.hostlist import expand
from gpuwarden.slurm.models import AcctJob, NodeEvent

T0 = 1_767_225_600
GRACE = 3600.0
STATES = ("FAILED", "FAILED", "NODE_FAIL", "BOOT_FAIL", "REQUEUED", "COMPLETED", "CANCELLED",
          "PENDING")
LISTS = ("n1", "n2", "n3", "n[1-2]", "n[1-4]", "n[2-3]", "n[1,3]", "n[01-02]", "n[1-2],m1",
         "m[1-2]x", "n[1]", "", "None assigned", "n[2-1]")
NODES = ("n1", "n2", "n3", "n4", "m1", "n01")


@st.composite
def records(draw: st.DrawFn) -> AcctJob:
    # Runs close together around a few events, so that two runs often claim one (rule 8).
    start = draw(st.one_of(st.none(), st.integers(T0, T0 + 6 * 3600)))
    length = draw(st.one_of(st.none(), st.sampled_from((-5, 0, 1, 600)), st.integers(0, 7200)))
    end = None if length is None else (start or T0) + length
    state = draw(st.sampled_from(STATES))
    return AcctJob(draw(st.integers(1, 30)), "j", draw(st.sampled_from(("alice", "bob"))), state,
                   "", "gpu", draw(st.sampled_from(LISTS)), 1,
                   draw(st.sampled_from((0, 1, 8, 16))), draw(st.sampled_from((0, 1, None))),
                   None, None, start, end, None, draw(st.sampled_from(("", "n1", "n2", "n4"))),
                   draw(st.sampled_from(("", "sbatch -w n1 x.sh", "sbatch x.sh",
                                         "sbatch -w n[1-2] y.sh"))))


def _iso(at: int) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S")


@st.composite
def events(draw: st.DrawFn) -> list[NodeEvent]:
    out = []
    for _ in range(draw(st.integers(0, 8))):
        at = T0 + draw(st.integers(0, 8 * 3600))
        reason = draw(st.sampled_from((
            "gpuwarden: xid 79 [health]", "Not responding", "gpuwarden: lemon: score 9.1",
            "maintenance")))
        out.append(NodeEvent("", draw(st.sampled_from(NODES)), _iso(at),
                             _iso(at + draw(st.sampled_from((60, 3600, 20_000)))), "DRAIN",
                             reason, "root"))
    return out


def summary(att: Attribution) -> tuple[Any, ...]:
    inc = att.incidence
    users, scripts = list(inc.users), list(inc.scripts)  # by number
    return (att.blames, {n: (e.jobs, e.seconds, dict(e.by_size))
                         for n, e in att.exposure.items() if e.jobs},
            dict(att.skipped), dict(att.runs_by_size), dict(att.pinned_by_size),
            dict(att.spread_by_size), dict(att.gpu_runs), dict(att.gpu_failures),
            {g: round(h, 6) for g, h in att.gpu_hours.items()},
            {g: round(h, 6) for g, h in att.class_gpu_hours.items()},
            att.first_start, att.first_end, att.last_end, att.pending,
            {s: round(h, 6) for s, h in inc.bucket_hours.items()}, inc.nodes, list(inc.node),
            list(inc.flags), list(inc.hours), list(inc.end), list(inc.job), list(inc.size),
            list(inc.gameable), [users[u] for u in inc.user],
            [scripts[k] if k >= 0 else None for k in inc.script],
            sorted((users[u], round(h, 6)) for u, h in inc.user_hours.items()),
            sorted((scripts[k], round(h, 6)) for k, h in inc.script_hours.items()),
            list(inc.ptr))


def _frame(jobs: list[AcctJob]) -> pl.DataFrame:
    rows = [tuple(getattr(j, n) for n in schema.NAMES) for j in jobs]
    return pl.DataFrame(rows, schema=schema.SCHEMA, orient="row")


def _store(jobs: list[AcctJob]) -> pl.LazyFrame:
    return _frame(jobs).lazy().with_row_index("rid")


def _rolled(jobs: list[AcctJob]) -> pl.LazyFrame:
    """The rollups of ``jobs`` stored as two files would hold them (summed over both)."""
    df = _frame(jobs)
    half = df.height // 2
    return pl.concat([rollup.of(df.head(half)), rollup.of(df.tail(df.height - half))]).lazy()


def _both(jobs: list[AcctJob], evs: list[NodeEvent], rolled: bool = False
          ) -> tuple[Attribution, Attribution]:
    drains, failures = by_node(health_drains(evs)), by_node(node_failures(evs))
    clears = lemon_clears(evs)
    one = attribute_runs(jobs, drains, GRACE, clears, failures, grouped=False)
    stored, tally = Attribution(), RangeTally()
    scan.attribute(_store(jobs), stored, drains, failures, clears, GRACE, tally,
                   _rolled(jobs) if rolled else None)
    spread_exposure(stored.exposure, tally)
    return one, stored


@settings(max_examples=100, deadline=None)
@given(st.lists(records(), max_size=40), events(), st.booleans())
def test_the_store_attributes_as_judging_each_record(jobs: list[AcctJob],
                                                     evs: list[NodeEvent], rolled: bool) -> None:
    """From the rows alone (a read `since`) and with the files' rollups alike."""
    one, stored = _both(jobs, evs, rolled)
    assert summary(stored) == summary(one)
    clears = lemon_clears(evs)
    drains = by_node(health_drains(evs))
    add_lone_drains(one, drains, GRACE, clears)
    add_lone_drains(stored, drains, GRACE, clears)
    assert summary(stored) == summary(one)  # rules 8 and 5 on top


def test_every_rule_is_met_by_a_hand_made_history() -> None:
    """The rules the property test must reach, on one history: a gang failure, node failures
    with sacct's node, a requeue an event explains, a one-node failure a drain explains, an
    event two failed runs claim, a lone drain, a repaired lemon."""
    h, d = "gpuwarden: xid 79 [health]", "Not responding"
    evs = [NodeEvent("", "n3", _iso(T0 + 1000), _iso(T0 + 1100), "DRAIN", h, "root"),
           NodeEvent("", "n2", _iso(T0 + 5000), _iso(T0 + 5100), "DOWN", d, "root"),
           NodeEvent("", "n4", _iso(T0 + 6000), _iso(T0 + 6100), "DRAIN", h, "root"),
           NodeEvent("", "n1", _iso(T0), _iso(T0 + 20_000), "DRAIN", "gpuwarden: lemon: 9",
                     "root")]

    def run(i: int, state: str, nodes: str, start: int, end: int, failed: str = "") -> AcctJob:
        return AcctJob(i, "j", "u", state, "", "gpu", nodes, 1, 8, 1, None, None, T0 + start,
                       T0 + end, None, failed, "sbatch x.sh")

    jobs = [run(1, "FAILED", "n[5-8]", 0, 600),  # rule 3
            run(2, "NODE_FAIL", "n[5-6]", 0, 700, "n6"),  # rule 1, sacct's node
            run(3, "REQUEUED", "n[2-3]", 0, 4990),  # rule 2: n2 went down at its end
            run(4, "FAILED", "n[2,7]", 0, 5030),  # rule 8: the same event, nearer to 3
            run(5, "FAILED", "n3", 500, 900),  # rule 4: drained after it failed
            run(6, "COMPLETED", "n[1-2]", 0, 600),  # rule 7: before n1's repair
            run(7, "FAILED", "n[1-2]", 0, 900)]  # rule 7 for a failed run
    one, stored = _both(jobs, evs)
    assert summary(stored) == summary(one)
    add_lone_drains(one, by_node(health_drains(evs)), GRACE, lemon_clears(evs))
    add_lone_drains(stored, by_node(health_drains(evs)), GRACE, lemon_clears(evs))
    assert summary(stored) == summary(one)
    why = {(b.job_id, b.node): b.reason for b in stored.blames}
    assert why[(1, "n5")].startswith("4-node job failed")
    assert why[(2, "n6")].endswith("Slurm recorded n6 as the node that failed")
    assert why[(3, "n2")].endswith("n2 failed at the time")
    assert (4, "n2") in why and (4, "n7") in why  # not n2's event: spread over both
    assert why[(5, "n3")].startswith("failed on a node health gating drained")
    assert (7, "n2") in why and (7, "n1") not in why  # n1's lemon drain was cleared after
    assert ("n4", None) in {(b.node, b.job_id) for b in stored.blames}  # a lone drain


@given(st.sampled_from([t for t in LISTS if countable(t)]))
def test_a_lists_names_are_those_expand_gives(text: str) -> None:
    assert list(_names(text)) == expand(text)


def test_blames_made_at_once_equal_the_dataclass() -> None:
    blames = Blames()
    blames.add_run(blames.numbers(("n1", "n2")), 0.5, 7, 10.0, "r", 2, False, 3.0, 8)
    got = list(blames)
    want = [Blame(n, 0.5, 7, 10.0, "r", 2, False, 3.0, 8) for n in ("n1", "n2")]
    assert got == want
    assert [hash(b) for b in got] == [hash(b) for b in want]
    assert [repr(b) for b in got] == [repr(b) for b in want]
