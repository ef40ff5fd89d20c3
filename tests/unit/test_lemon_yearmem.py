"""The lemon scoring's memory at a year of a fleet (issue 36): the incidence's per-entry
arrays are int32 and the builder's own buffers, and the distinct hazards are found block by
block; every result is the one the whole-array, int64 way gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.incidence import IncidenceBuilder
from gpuwarden.lemon import distinct

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
