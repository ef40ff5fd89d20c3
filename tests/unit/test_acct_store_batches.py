"""The store's failed runs are made into objects a batch at a time (`store.schema.Batch`):
a year holds millions, and every one held as an object at once was most of the report's
memory. Any batch size gives the same figures, and the same tallies in the same order."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.history import from_store
from gpuwarden.accounting.store import scan, schema
from gpuwarden.accounting.store.ingest import ingest
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report.build import Options, as_json, build
from gpuwarden.report.collect import Blamable, RunTally
from tests.unit.test_acct_store_golden import DAY, T0, _events, _export, _record, event_st, run_st

SMALL = 3


def _store(d: Path, runs: list[tuple[Any, ...]], raw: list[tuple[str, int, str]]) -> str:
    recs = [_record(i, r) for i, r in enumerate(runs)]
    _export(d / "day.json", recs, T0, T0 + 3 * DAY)
    ingest(d / "store", [str(d / "day.json")], _events(raw), workers=1)
    return str(d / "store")


def _read(store: str, blamable: Blamable | None,
          since: float | None = None) -> tuple[Any, RunTally]:
    hist = from_store(store, collector=RunTally.factory(None, blamable,
                                                        frozenset(range(1000, 1040, 2))),
                      since=since)
    try:
        figures: Any = as_json(build(hist, Options("x"), ScoreConfig(min_failures=1,
                                                                     min_jobs=1)))
    except IndexError as exc:  # a known fault of the scoring (test_acct_store_golden)
        figures = f"IndexError: {exc}"
    tally = hist.collected
    assert isinstance(tally, RunTally)
    return figures.replace(_generated(figures), "") if isinstance(figures, str) else figures, \
        tally


def _generated(text: str) -> str:
    at = text.find('"generated"')
    return text[at:text.find("\n", at)] if at >= 0 else "\0"


def _batched(store: str, blamable: Blamable | None) -> tuple[Any, RunTally, list[int]]:
    """`_read` with batches of `SMALL` rows; how many rows each batch made into objects
    (`schema.Batch`: column lists, and records of some)."""
    made: list[int] = []

    class Counted(schema.Batch):
        def __init__(self, df: pl.DataFrame) -> None:
            made.append(df.height)
            super().__init__(df)
    with mock.patch.object(schema, "BATCH", SMALL, create=True), \
            mock.patch.object(schema, "Batch", Counted):
        figures, tally = _read(store, blamable)
    return figures, tally, made


def _same_tallies(a: RunTally, b: RunTally) -> None:
    assert list(a.cells.items()) == list(b.cells.items())
    assert list(a.blamable.items()) == list(b.blamable.items())
    assert a.requeued == b.requeued and list(a.requeued) == list(b.requeued)
    assert a.watched == b.watched and a.watched_users == b.watched_users
    assert (a.never_ran, a.cpu_runs, a.gpu_seconds) == (b.never_ran, b.cpu_runs, b.gpu_seconds)


FAILED = [("n[01-02]", "FAILED", 8, T0 + 100 * i, 600, 1, "ann", "a.sh", "n01")
          for i in range(10)] + [("n01,n05", "COMPLETED", 8, T0 + 50, 100, 1, "bob", "b.sh",
                                  "n01")]


@pytest.mark.parametrize("with_events", [True, False])
def test_failed_runs_are_made_into_records_a_batch_at_a_time(tmp_path: Path,
                                                             with_events: bool) -> None:
    raw = [("n01", T0 + 500, "health"), ("n02", T0 + 900, "down")]
    store = _store(tmp_path, FAILED, raw)
    blamable = Blamable.of(_events(raw)) if with_events else None
    figures, tally = _read(store, blamable)
    got, small, made = _batched(store, blamable)
    assert max(made) == SMALL  # eleven runs the rules look at one by one, never all at once
    assert sum(made) == len(FAILED)  # each made once: the report's tally reads the same
    assert got == figures
    _same_tallies(small, tally)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(run_st, min_size=1, max_size=40),
       st.lists(event_st, max_size=8, unique_by=lambda e: (e[0], e[1], e[2])),
       st.booleans())
def test_any_batch_or_piece_size_gives_the_same_report_and_tallies(
        tmp_path_factory: pytest.TempPathFactory, runs: list[tuple[Any, ...]],
        raw: list[tuple[str, int, str]], with_events: bool) -> None:
    store = _store(tmp_path_factory.mktemp("b"), runs, raw)
    blamable = Blamable.of(_events(raw)) if with_events else None
    figures, tally = _read(store, blamable)
    got, small, _ = _batched(store, blamable)
    assert got == figures
    _same_tallies(small, tally)
    with mock.patch.object(scan, "SLICE", 1):  # each file of the store a piece of its own
        got, small = _read(store, blamable)
    assert got == figures
    _same_tallies(small, tally)
