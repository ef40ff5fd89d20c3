"""The store's runs that are not plain are read in one pass, a piece of whole files at a time
(`store.scan.pieces`, `_rest`): a year's failed runs read at once held 1.2 GiB, and the
drained runs read in a pass of their own took a third of that read. Any piece size gives the
same figures, read `since` too."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import polars as pl
import pytest

from gpuwarden.accounting.store import scan
from gpuwarden.report.collect import Blamable
from tests.unit.test_acct_store_batches import FAILED, _read, _same_tallies, _store
from tests.unit.test_acct_store_golden import DAY, T0, _events

SMALL = 3
# Failed runs over three days: three files of the store. Each day, a one-node FAILED run
# that a health drain explains (days 0 and 1; `_drained`'s) or none does (day 2: plain).
DAYS = [(n, st, g, start + day * DAY, length, r, u, sc, f)
        for day in range(3) for (n, st, g, start, length, r, u, sc, f) in FAILED[:4]] + [
    (f"n0{day + 1}", "FAILED", 8, T0 + 400 + day * DAY, 300, 0, "cat", "c.sh", "")
    for day in range(3)]
RAW = [("n01", T0 + 500, "health"), ("n02", T0 + DAY + 600, "health"),
       ("n02", T0 + DAY + 900, "down")]


found: list[int] = []  # how many drained runs each piece held


def _sliced(store: str, blamable: Blamable | None, since: float | None = None,
            size: int = SMALL) -> tuple[Any, Any, list[int]]:
    """`_read` with pieces of at most ``size`` rows (a file more is a piece of its own); the
    rows each look for the drained runs saw."""
    seen: list[int] = []
    drained = scan._drained

    def counted(rows: pl.LazyFrame, *args: Any) -> pl.Series:
        seen.append(rows.select(pl.len()).collect().item())
        got = drained(rows, *args)
        found.append(got.len())
        return got
    with mock.patch.object(scan, "SLICE", size), mock.patch.object(scan, "_drained", counted):
        figures, tally = _read(store, blamable, since)
    return figures, tally, seen


@pytest.mark.parametrize("with_events", [True, False])
def test_the_runs_that_are_not_plain_are_read_a_piece_at_a_time(tmp_path: Path,
                                                                with_events: bool) -> None:
    store = _store(tmp_path, DAYS, RAW)
    blamable = Blamable.of(_events(RAW)) if with_events else None
    figures, tally = _read(store, blamable)
    found.clear()
    got, small, seen = _sliced(store, blamable)
    # The drained runs are found among each file's runs that may not be plain (its gang
    # runs and its one-node FAILED run), never over every row of the store in a pass of
    # their own.
    assert seen == [5, 5, 5] and found == [1, 1, 0]
    assert got == figures
    _same_tallies(small, tally)
    _, _, whole = _sliced(store, blamable, size=100)
    assert whole == [15]  # files held together up to the size


@pytest.mark.parametrize("since", [T0 + 200, T0 + 650, T0 + DAY + 100, T0 + 2 * DAY + 350])
def test_a_read_since_gives_the_same_figures_in_pieces(tmp_path: Path, since: int) -> None:
    store = _store(tmp_path, DAYS, RAW)
    blamable = Blamable.of(_events(RAW))
    figures, tally = _read(store, blamable, since)
    got, small, _ = _sliced(store, blamable, since)
    assert got == figures
    _same_tallies(small, tally)
