"""The year read's second pass (issue 36): each shortcut answers as the plain way it stands
in for: a failed gang's culprits in its list's order, its flags, whether any event of a list's
nodes is near a run's end (by buckets), the blamed runs once each (by numpy), event times
read once."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.accounting import attribution
from gpuwarden.accounting.attribution import (
    GRACE_S,
    LEAD_S,
    Attribution,
    HealthDrain,
    _parse_time,
    event_time,
    in_order,
)
from gpuwarden.accounting.blames import Blames
from gpuwarden.accounting.counted import _Buckets
from gpuwarden.accounting.incidence import CULPRIT, NAMED, _flags
from gpuwarden.report.collect import RunTally, run_key
from gpuwarden.report.outcomes import _blamed_one_by_one, blamed_runs

NAMES = [f"n{i:02d}" for i in range(40)]
lists_st = st.lists(st.sampled_from(NAMES), min_size=0, max_size=40).map(tuple)
few_st = st.sets(st.sampled_from(NAMES), max_size=6)


@given(lists_st, few_st)
def test_in_order_is_the_list_filtered(nodes: tuple[str, ...], few: set[str]) -> None:
    assert in_order(nodes, few) == [n for n in nodes if n in few]


@given(lists_st, few_st, few_st)
def test_flags_are_each_nodes_own(nodes: tuple[str, ...], culprit: set[str],
                                  named: set[str]) -> None:
    want = [(CULPRIT if n in culprit else 0) | (NAMED if n in named else 0) for n in nodes]
    assert list(_flags(nodes, culprit, named)) == want


times_st = st.lists(st.integers(-10**4, 10**6).map(float), max_size=20)


@given(st.dictionaries(st.sampled_from(NAMES[:6]), times_st, min_size=1),
       st.integers(-2 * 10**4, 11 * 10**5), st.sampled_from([0.0, 60.0, GRACE_S]),
       st.booleans())
def test_buckets_never_say_none_where_an_event_is_near(by_node: dict[str, list[float]],
                                                       end: int, grace_s: float,
                                                       spread: bool) -> None:
    failures = {n: [HealthDrain(n, t, "r") for t in ts] for n, ts in by_node.items()}
    if spread:  # a span wider than SPAN buckets: wider buckets
        failures["far"] = [HealthDrain("far", 1e12, "r")]
    buckets = _Buckets(failures, grace_s)
    bits = buckets.of(by_node)
    near = any(end - LEAD_S <= t <= end + grace_s for ts in by_node.values() for t in ts)
    if near:
        assert not buckets.none_near(bits, end)
    if not any(by_node.values()):
        assert buckets.none_near(bits, end)


def _att(runs: list[tuple[Any, ...]]) -> Attribution:
    b = Blames()
    for nodes, job, at in runs:
        b.add_run(b.numbers(nodes), 1.0 / len(nodes), job, at, "r", 1, len(nodes) == 1, at,
                  8)
    return Attribution(blames=b)


run_st = st.tuples(st.lists(st.sampled_from(NAMES[:4]), min_size=1, max_size=3),
                   st.one_of(st.none(), st.integers(1, 20)),
                   st.integers(0, 30).map(lambda t: t * 0.5))


@given(st.lists(run_st, max_size=15), st.booleans())
def test_blamed_runs_by_numpy_are_the_runs_one_by_one(runs: list[tuple[Any, ...]],
                                                      big_job: bool) -> None:
    if big_job and runs:  # a job id past 31 bits: the runs one by one
        runs[0] = (runs[0][0], 1 << 40, runs[0][2])
    att = _att(runs)
    tally = RunTally()
    for k, (_, job, at) in enumerate(runs):
        if job is not None and k % 2:
            tally.blamable[run_key(job, int(at))] = ((0, "p", "FAILED"), 8, 1, "u", None)
    got = list(blamed_runs(tally, att))
    firsts = list(att.blames.firsts())
    ran = [b for b in firsts if b.job_id is not None]
    want = list(_blamed_one_by_one(tally, [b.job_id for b in ran],  # type: ignore[misc]
                                   [int(b.at) for b in ran], [b.pinned for b in ran]))
    assert got == want


def test_an_event_time_is_read_once_and_the_same_each_time() -> None:
    text = "2026-03-01T10:00:00"
    first = event_time(text)
    assert first == 1772359200.0
    assert attribution._TIMES[text] == first
    assert event_time(text) == first
    assert event_time("Unknown") is None
    assert event_time("Unknown") is None


@given(st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1)),
       st.sampled_from(["seconds", "microseconds"]), st.booleans())
def test_event_times_are_utcs_timestamps(at: datetime, spec: str, zoned: bool) -> None:
    text = at.isoformat(timespec=spec) + ("+00:00" if zoned else "")
    read = datetime.fromisoformat(text)
    assert _parse_time(text) == (read if zoned else read.replace(tzinfo=UTC)).timestamp()
