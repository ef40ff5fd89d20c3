"""The lemon scoring's memory at a year of a fleet (issue 36): the incidence's per-entry
arrays are int32 and the builder's own buffers, the distinct hazards are found block by
block, a run's row is found by sorted numbers, each annotated reason is made once, a node's
own share is the share itself where it can be, and the design is let go once the fits are
done; every result is the one the old way gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.incidence import IncidenceBuilder
from gpuwarden.lemon import distinct, inference
from gpuwarden.lemon.explain import RowIndex, RowView
from gpuwarden.lemon.inference import fit

entries_st = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=5), min_size=1,
                      max_size=30)


@settings(max_examples=150, deadline=None)
@given(entries_st, st.integers(1, 7), st.integers(0, 2**32 - 1))
def test_distinct_rows_by_blocks_is_the_rows_at_once(lists: list[list[int]], block: int,
                                                    seed: int) -> None:
    """Blocks of a few entries (a row never split) give what one block of all gives, at
    int32 and int64 alike."""
    rng = np.random.default_rng(seed)
    rows = len(lists)
    node = np.array([n for ns in lists for n in ns], dtype=np.int64)
    row = np.repeat(np.arange(rows), [len(ns) for ns in lists])
    size = rng.integers(1, 3, rows)
    bg_use = rng.choice([0.0, 1.0, 0.5], rows)
    take = rng.random(rows) < 0.9
    whole = distinct.distinct_rows(node, row, rows, size, bg_use, take)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(distinct, "BLOCK", block)
        small = distinct.distinct_rows(node.astype(np.int32), row.astype(np.int32), rows,
                                       size, bg_use, take)
    finally:
        mp.undo()
    for a, b in ((whole.reps, small.reps), (whole.node, small.node),
                 (whole.row, small.row), (whole.of_run, small.of_run)):
        assert a.tolist() == b.tolist()


def test_a_hash_collision_keeps_rows_apart_across_blocks(monkeypatch: Any) -> None:
    """Every row hashed alike, blocks of one row: only equal rows merge."""
    monkeypatch.setattr(distinct, "_mix", lambda x: x & np.uint64(0))
    monkeypatch.setattr(distinct, "BLOCK", 1)
    node = np.array([0, 1, 1, 0, 0, 1, 3], dtype=np.int32)
    row = np.array([0, 0, 1, 1, 2, 2, 3], dtype=np.int32)
    got = distinct.distinct_rows(node, row, 4, np.ones(4, dtype=np.int64), np.ones(4),
                                 np.ones(4, dtype=bool))
    assert got.of_run.tolist() == [0, 1, 0, 2]


def _builder() -> IncidenceBuilder:
    b = IncidenceBuilder()
    b.add_failure(7, 1.0, 2.0, 2, ("a", "b"), ("b",), (), "u", "s.sh", False)
    b.add_failure(8, 2.0, 1.0, 1, ("c",), (), ("c",), "v", "", True)
    b.add_plain_failures([9], [3.0], [4.0], [3], [b.node_numbers(("a", "c", "d"))], ["u"],
                         ["s.sh"], [True])
    return b


def test_frozen_entries_are_int32_and_the_builders_own_buffers() -> None:
    """No int64 copy of the entries beside the builder's: its buffers, read in place."""
    b = _builder()
    inc = b.freeze({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0, "e": 1.0})
    assert inc.node.dtype == np.int32 and inc.flags.dtype == np.int8
    assert np.shares_memory(inc.node, np.frombuffer(b.node, dtype=np.int32))
    assert np.shares_memory(inc.flags, np.frombuffer(b.flags, dtype=np.int8))
    assert inc.node.tolist() == [0, 1, 2, 0, 2, 3]
    assert inc.flags.tolist() == [0, 1, 2, 0, 0, 0]
    assert inc.entry_row().dtype == np.int32
    assert inc.entry_row().tolist() == [0, 0, 1, 2, 2, 2]
    order, bounds = inc.by_node()
    assert order.dtype == np.int32
    assert order.tolist() == [0, 3, 1, 2, 4, 5] and bounds.tolist() == [0, 2, 3, 5, 6, 6]


def _with_rows(jobs: list[int], ends: list[float]) -> Any:
    b = IncidenceBuilder()
    for j, t in zip(jobs, ends, strict=True):
        b.add_failure(j, t, 1.0, 1, ("a",))
    return b.freeze({"a": 1.0})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([-1, 3, 4, 10**12]),
                          st.sampled_from([0.0, -0.0, 1.5, 2.0, float("nan")])),
                max_size=12),
       st.lists(st.tuples(st.sampled_from([-1, 3, 5, 10**12]),
                          st.sampled_from([0.0, -0.0, 1.5, 3.0, float("nan")])),
                max_size=12))
def test_row_index_finds_what_a_dict_of_the_rows_finds(rows: list[tuple[int, float]],
                                                       asked: list[tuple[int, float]]) -> None:
    """The last row with the job and the end, -1 for none (a NaN end finds none)."""
    inc = _with_rows([j for j, _ in rows], [t for _, t in rows])
    table = {(int(j), float(t)): r for r, (j, t) in
             enumerate(zip(inc.job.tolist(), inc.end.tolist(), strict=True))}
    want = [table.get((j, t), -1) for j, t in asked]
    got = RowIndex(inc).rows(np.array([j for j, _ in asked], dtype=np.int64),
                             np.array([t for _, t in asked], dtype=np.float64))
    assert got.tolist() == want


def test_each_annotated_reason_is_made_once() -> None:
    index = RowIndex(_with_rows([1], [1.0]))
    a = index.reason("".join(["4-node job ", "failed"]), "".join(["100% of it ", "here"]))
    b = index.reason("4-node job failed", "100% of it here")
    assert a == "4-node job failed; 100% of it here" and a is b


def test_a_nodes_own_share_is_the_share_itself_where_no_row_lists_it_twice() -> None:
    b = IncidenceBuilder()
    b.add_failure(1, 1.0, 1.0, 2, ("a", "b"))
    b.add_failure(2, 2.0, 1.0, 1, ("b",))
    inc = b.freeze({"a": 5.0, "b": 5.0})
    f = fit(inc)
    view = RowView.of(inc, f)
    assert view.own is view.share
    twice = IncidenceBuilder()
    twice.add_failure(1, 1.0, 1.0, 2, ("a", "a", "b"))
    inc2 = twice.freeze({"a": 5.0, "b": 5.0})
    v2 = RowView.of(inc2, fit(inc2))
    assert v2.own[0] == v2.own[1] == v2.share[0] + v2.share[1]


def test_the_share_is_the_rate_times_use_over_the_hazard() -> None:
    b = IncidenceBuilder()
    b.add_failure(1, 1.0, 1.0, 2, ("a", "b"), ("a",))
    b.add_failure(2, 2.0, 1.0, 1, ("b",))
    b.add_failure(3, 3.0, 1.0, 2, ("a", "c"))
    inc = b.freeze({"a": 5.0, "b": 5.0, "c": 0.0})
    f = fit(inc)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.nan_to_num(f.rate[inc.node] * f.use / f.row_rate[inc.entry_row()])
    assert f.share(inc).tolist() == want.tolist()


def test_the_scoring_forgets_the_design_once_its_fits_are_done() -> None:
    b = IncidenceBuilder()
    b.add_failure(1, 1.0, 1.0, 2, ("a", "b"))
    inc = b.freeze({"a": 5.0, "b": 5.0})
    fit(inc)
    assert inc in inference._PLAIN
    inference.release(inc)
    assert inc not in inference._PLAIN


def test_the_entries_that_count_are_marked_with_a_byte_each() -> None:
    """`use` is a bool per entry (not a float64 of 0 or 1): with sources left out too."""
    b = IncidenceBuilder()
    b.add_failure(1, 1.0, 1.0, 2, ("a", "b"), ("a",))
    b.add_failure(2, 2.0, 1.0, 1, ("b",), (), ("b",), "u", "", True)
    b.add_failure(3, 3.0, 1.0, 2, ("a", "c"), (), (), "u", "", True)
    inc = b.freeze({"a": 5.0, "b": 5.0, "c": 5.0})
    for keep in (None, np.array([1.0, 1.0, 1.0, 0.0, 0.0])):
        f = fit(inc, keep=keep)
        assert f.use.dtype == np.bool_
        assert f.use.tolist() == inference._design(inc, keep)[1].tolist()
    assert fit(inc).use.tolist() == [True, False, False, True, True]
    assert fit(inc, keep=np.array([1.0, 1.0, 1.0, 0.0, 0.0])).use.tolist() == [
        True, False, False, False, False]
