"""The store's runs that are not plain are read in one pass, a slice of rows at a time
(`store.scan._rest`): a year's failed runs read at once held 1.2 GiB, and the drained runs
read in a pass of their own took a third of that read. Any slice gives the same figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.store import scan
from gpuwarden.report.collect import Blamable
from tests.unit.test_acct_store_batches import FAILED, _read, _same_tallies, _store
from tests.unit.test_acct_store_golden import _events, event_st, run_st

SMALL = 3


def _sliced(store: str, blamable: Blamable | None) -> tuple[Any, Any, list[int]]:
    """`_read` with slices of `SMALL` rows; the rows each pass for the drained runs saw."""
    seen: list[int] = []
    drained = scan._drained

    def counted(rows: pl.LazyFrame, *args: Any) -> pl.Series:
        seen.append(rows.select(pl.len()).collect().item())
        return drained(rows, *args)
    with mock.patch.object(scan, "SLICE", SMALL), mock.patch.object(scan, "_drained", counted):
        figures, tally = _read(store, blamable)
    return figures, tally, seen


@pytest.mark.parametrize("with_events", [True, False])
def test_the_runs_that_are_not_plain_are_read_a_slice_at_a_time(tmp_path: Path,
                                                                 with_events: bool) -> None:
    raw = [("n01", T0_EVENT, "health"), ("n02", T0_EVENT + 400, "down")]
    store = _store(tmp_path, FAILED, raw)
    blamable = Blamable.of(_events(raw)) if with_events else None
    figures, tally = _read(store, blamable)
    got, small, seen = _sliced(store, blamable)
    # The drained runs are found among each slice's rows that may not be plain, never over
    # every row of the store in a pass of their own.
    assert len(seen) == -(-len(FAILED) // SMALL) and max(seen) <= SMALL
    assert got == figures
    _same_tallies(small, tally)


T0_EVENT = FAILED[0][3] + 500


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(run_st, min_size=1, max_size=40),
       st.lists(event_st, max_size=8, unique_by=lambda e: (e[0], e[1], e[2])),
       st.booleans())
def test_any_slice_gives_the_same_report_and_tallies(
        tmp_path_factory: pytest.TempPathFactory, runs: list[tuple[Any, ...]],
        raw: list[tuple[str, int, str]], with_events: bool) -> None:
    store = _store(tmp_path_factory.mktemp("s"), runs, raw)
    blamable = Blamable.of(_events(raw)) if with_events else None
    figures, tally = _read(store, blamable)
    got, small, _ = _sliced(store, blamable)
    assert got == figures
    _same_tallies(small, tally)
