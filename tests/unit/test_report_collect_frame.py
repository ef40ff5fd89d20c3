"""The report's tally of the store's runs that are not plain, on columns
(`RunTally.add_frame`): the same tallies, in the same order, as tallying each record on its own
(`_add_one`, the reference), whatever the states, node lists, times, requeues and drains."""

from __future__ import annotations

from datetime import UTC, datetime

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.store import schema
from gpuwarden.report.collect import Blamable, RunTally
from gpuwarden.slurm.models import AcctJob, NodeEvent

T0 = 1_767_225_600
# None: a store row without a state (never blamed, as a record without one).
STATES = (None, "FAILED", "FAILED", "NODE_FAIL", "BOOT_FAIL", "REQUEUED", "COMPLETED",
          "CANCELLED", "PENDING", "TIMEOUT")
LISTS = ("n1", "n2", "n[1-2]", "n[1-4]", "n[1,3]", "n[1-2],m1", "m[1-2]x", "n[1]", "",
         "None assigned", "(null)", "n[2-1]", "n[a-b]", "n[1-2000000]", None)
NODES = ("n1", "n2", "n3", "n4", "m1")
LEAVES = {"n1": "a", "n2": "a", "n3": "b", "n4": "b"}  # m1: no leaf


@st.composite
def records(draw: st.DrawFn) -> AcctJob:
    start = draw(st.one_of(st.none(), st.just(0), st.integers(T0, T0 + 3 * 86_400)))
    length = draw(st.one_of(st.none(), st.sampled_from((-5, 0, 1, 600)),
                            st.integers(0, 90_000)))
    end = draw(st.one_of(st.just(0), st.just(None))) if length is None else (start or T0) + length
    submit = draw(st.one_of(st.none(), st.just(0), st.integers(T0 - 600, T0 + 3 * 86_400)))
    return AcctJob(draw(st.integers(1, 12)), "", draw(st.sampled_from(("alice", "bob"))),
                   draw(st.sampled_from(STATES)), "",
                   draw(st.sampled_from(("gpu", "", "cpu"))), draw(st.sampled_from(LISTS)), 0,
                   draw(st.sampled_from((0, 1, 8, 16))), draw(st.sampled_from((0, 1, None))),
                   None, submit, start, end, draw(st.sampled_from((None, 0, 1, 3))),
                   draw(st.sampled_from(("", "n1", "n2"))), "sbatch x.sh")


def _iso(at: int) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S")


@st.composite
def events(draw: st.DrawFn) -> list[NodeEvent]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        at = T0 + draw(st.integers(0, 3 * 86_400))
        reason = draw(st.sampled_from(("gpuwarden: xid 79 [health]", "Not responding",
                                       "maintenance")))
        out.append(NodeEvent("", draw(st.sampled_from(NODES)), _iso(at), _iso(at + 3600),
                             "DRAIN", reason, "root"))
    return out


def _frame(jobs: list[AcctJob]) -> pl.DataFrame:
    rows = [tuple(getattr(j, n) for n in schema.NAMES) for j in jobs]
    return pl.DataFrame(rows, schema=schema.SCHEMA, orient="row").select(schema.READ)


def _tallies(t: RunTally) -> tuple[object, ...]:
    # Each mapping's items in order: a report reading them in order gets the same bytes.
    return (list(t.cells.items()), list(t.blamable.items()), list(t.requeued.items()),
            list(t.watched.items()), list(t.watched_users.items()), t.never_ran, t.cpu_runs,
            list(t.gpu_seconds.items()), list(t.gang_runs.items()),
            list(t.gang_wait_s.items()), list(t.gang_waited.items()))


def _both(jobs: list[AcctJob], evs: list[NodeEvent] | None, topology: bool
          ) -> tuple[RunTally, RunTally]:
    blamable = None if evs is None else Blamable.of(evs)
    leaves = LEAVES if topology else None
    one, cols = (RunTally(leaves, blamable, frozenset({2, 3, 5})) for _ in range(2))
    for j in jobs:
        one._add_one(j)
    cols.add_frame(_frame(jobs))
    return one, cols


@settings(max_examples=150, deadline=None)
@given(st.lists(records(), max_size=40), st.one_of(st.none(), events()), st.booleans())
def test_the_tally_on_columns_is_the_tally_of_each_record(jobs: list[AcctJob],
                                                          evs: list[NodeEvent] | None,
                                                          topology: bool) -> None:
    one, cols = _both(jobs, evs, topology)
    assert _tallies(cols) == _tallies(one)


def test_a_hand_made_history_of_each_kind_of_run() -> None:
    drain = NodeEvent("", "n1", _iso(T0 + 500), _iso(T0 + 900), "DRAIN",
                      "gpuwarden: xid 79 [health]", "root")
    down = NodeEvent("", "n3", _iso(T0 + 1200), _iso(T0 + 4000), "DOWN", "Not responding",
                     "root")

    def run(job: int, state: str, nodes: str | None, start: int | None, end: int | None,
            gpus: int = 8, restarts: int | None = 0, submit: int | None = T0 - 60) -> AcctJob:
        return AcctJob(job, "", "ann", state, "", "gpu", nodes, 0, gpus, 1, None,  # type: ignore[arg-type]
                       submit, start, end, restarts, "", "")
    jobs = [
        run(1, "FAILED", "n1", T0, T0 + 600),  # one node, drained while it ran: blamable
        run(2, "FAILED", "n2", T0, T0 + 600),  # one node, no drain: not kept
        run(3, "FAILED", "n[1-4]", T0, T0 + 1000, restarts=2),  # a gang: blamable, requeued
        run(3, "REQUEUED", "n3", T0 + 100, T0 + 1300),  # a failure near its end: blamable
        run(4, "REQUEUED", "n4", T0, T0 + 100),  # none: not kept
        run(5, "NODE_FAIL", "n[1-2],m1", T0, T0 + 50, gpus=0),  # odd list, no GPUs
        run(6, "PENDING", "None assigned", None, None),  # never ran
        run(7, "CANCELLED", None, None, None),  # never ran
        run(8, "COMPLETED", "", T0, T0 + 5),  # no nodes: skipped
        run(9, "FAILED", "n[2-1]", T0, T0 + 5),  # unreadable: skipped
        run(10, "COMPLETED", "n[1-2]", 0, T0 + 5, submit=0),  # start 0: a run
        run(11, "TIMEOUT", "n[1-2]", T0 + 10, T0),  # ends before it starts: skipped
        run(12, "FAILED", "n[1-2]", T0, None),  # no end: skipped
        run(5, "BOOT_FAIL", "n1", T0 + 86_400, T0 + 86_401, restarts=None),
    ]
    one, cols = _both(jobs, [drain, down], True)
    assert _tallies(cols) == _tallies(one)
    assert one.never_ran == 2 and one.cpu_runs == 1
    assert sorted(k >> 32 for k in one.blamable) == [1, 3, 3, 5, 5]
