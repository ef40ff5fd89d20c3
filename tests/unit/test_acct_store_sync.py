"""`accounting sync`: slurmdbd's windows since the last sync pulled into the store, a day per
call, a run stored once (in the window it ended in), the sync's end (the settle delay before
now) kept for the next one; a run slurmdbd records late is still stored; spans the store holds
from exports are skipped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuwarden.accounting.history import from_store
from gpuwarden.accounting.store import manifest
from gpuwarden.accounting.store.ingest import ingest
from gpuwarden.accounting.store.manifest import StoreError
from gpuwarden.accounting.store.sync import SETTLE, sync
from gpuwarden.core.errors import SlurmError
from gpuwarden.slurm.models import AcctJob, NodeEvent
from gpuwarden.slurm.runner import CommandTimeoutError
from tests.unit.test_acct_store import export

NOW = datetime(2026, 11, 29, 12, tzinfo=UTC)
FMT = "%Y-%m-%dT%H:%M:%S"


def _t(s: str) -> float:
    return datetime.strptime(s, FMT).replace(tzinfo=UTC).timestamp()


class Slurmdbd:
    """Every run that overlaps a window, as sacct lists them; the events of a span."""

    def __init__(self, runs: list[AcctJob], slow_over: timedelta | None = None) -> None:
        self.runs, self.calls, self.slow_over = runs, [], slow_over

    def window(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]:
        self.calls.append((start, end))
        lo, hi = _t(start), _t(end)
        if self.slow_over is not None and hi - lo > self.slow_over.total_seconds():
            raise CommandTimeoutError(["sacct", "--json"], 5)
        return iter([r for r in self.runs if (r.start_time or 0) < hi
                     and (r.end_time is None or r.end_time >= lo)])

    def acct_jobs(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]:
        return self.window(start, end)

    def events(self, start: str, end: str) -> list[NodeEvent]:
        return [NodeEvent("c", "n01", "2026-11-28T03:00:00", "2026-11-28T04:00:00", "DRAIN",
                          "gpuwarden: [health] xid 79", "root")]


class NoEvents:
    def events(self, start: str, end: str) -> list[NodeEvent]:
        return []


def run(i: int, end: datetime, hours: float = 30) -> AcctJob:
    e = int(end.timestamp())
    return AcctJob(i, "j", "ann", "COMPLETED", "None", "gpu", "n[01-02]", 2, 16, 0, None,
                   e - int(hours * 3600) - 60, e - int(hours * 3600), e, 0)


def test_sync_pulls_each_run_once_and_goes_on_from_where_it_ended(tmp_path: Path) -> None:
    db = Slurmdbd([run(1, NOW - timedelta(hours=20)), run(2, NOW - timedelta(hours=1))])
    got = sync(str(tmp_path), db, db, timedelta(days=2), NOW)  # type: ignore[arg-type]
    assert len(db.calls) == 2 and got.rows == 2  # a day per call; the long run counted once
    assert from_store(str(tmp_path)).records == 2
    assert manifest.load(tmp_path).synced_to == (NOW - SETTLE).timestamp()
    later = NOW + timedelta(hours=6)
    db.runs.append(run(3, later - timedelta(hours=2), hours=1))
    got = sync(str(tmp_path), db, db, timedelta(days=2), later)  # type: ignore[arg-type]
    assert db.calls[-1] == ((NOW - SETTLE).strftime(FMT), (later - SETTLE).strftime(FMT))
    assert got.rows == 1
    hist = from_store(str(tmp_path))
    assert hist.records == 3 and len(hist.events) == 1


def test_a_window_sacct_cannot_answer_is_read_as_halves(tmp_path: Path) -> None:
    db = Slurmdbd([run(1, NOW - timedelta(hours=3), hours=1)], slow_over=timedelta(hours=7))
    got = sync(str(tmp_path), db, db, timedelta(days=1), NOW)  # type: ignore[arg-type]
    assert got.rows == 1 and len(db.calls) == 1 + 2 + 4  # 24 h, 2 x 12 h, 4 x 6 h


def _failed(i: int, end: int) -> AcctJob:
    return AcctJob(i, "j", "ann", "FAILED", "", "gpu", "n01", 1, 8, 1, None, end - 700,
                   end - 600, end, 0, "", "sbatch a.sh")


def test_a_run_slurmdbd_records_late_is_still_stored(tmp_path: Path) -> None:
    """The review's sync_lag: a run that ended 30 s before a sync reaches slurmdbd just after
    it (slurmctld's agent queue); the next sync still stores it."""
    db = Slurmdbd([])
    sync(str(tmp_path), db, db, timedelta(days=1), now=NOW)  # type: ignore[arg-type]
    db.runs.append(_failed(1, int(NOW.timestamp()) - 30))
    sync(str(tmp_path), db, db, timedelta(days=1),  # type: ignore[arg-type]
         now=NOW + timedelta(hours=1))
    assert from_store(str(tmp_path)).records == 1


def test_the_first_sync_after_an_ingest_pulls_only_what_the_exports_do_not_hold(
        tmp_path: Path) -> None:
    """The review's sync_lag, second half: exports ingested, then the timer's first sync,
    whose span (sync_since back) covers them: it pulls around them, never refuses."""
    lo = int(NOW.timestamp()) - 3 * 86_400
    ingest(tmp_path / "s", [export(tmp_path / "exp.json", lo, lo + 2 * 86_400, [lo + 100])])
    db = Slurmdbd([_failed(7, lo - 50), _failed(8, lo + 200), _failed(9, lo + 2 * 86_400 + 5)])
    quiet = NoEvents()  # the fake's events are of another cluster than the export's
    got = sync(str(tmp_path / "s"), quiet, db, timedelta(days=4), NOW)  # type: ignore[arg-type]
    start, end = (NOW - SETTLE - timedelta(days=4)).timestamp(), (NOW - SETTLE).timestamp()
    day = 86_400
    assert [(_t(a), _t(b)) for a, b in db.calls] == [  # a day per call, around the export
        (start, start + day), (start + day, lo), (lo + 2 * day, end)]
    assert got.rows == 2  # run 8 ended inside the export's window: the export's
    assert from_store(str(tmp_path / "s")).records == 3
    assert sync(str(tmp_path / "s"), quiet, db, timedelta(days=4),  # type: ignore[arg-type]
                NOW + timedelta(hours=1)).rows == 0


def test_an_export_without_an_end_stops_the_sync_saying_how_to_recover(tmp_path: Path) -> None:
    lo = int(NOW.timestamp()) - 3 * 86_400
    path = export(tmp_path / "open.json", lo, lo + 86_400, [lo + 100])
    doc = json.loads(Path(path).read_text())
    doc["meta"]["command"] = [c for c in doc["meta"]["command"]
                              if not c.startswith(("--endtime", "-E"))]
    Path(path).write_text(json.dumps(doc))
    got = ingest(tmp_path / "s", [path])
    assert got.store.exports[0].hi is None, "the export must have lost its end for this test"
    db = Slurmdbd([])
    with pytest.raises(StoreError, match=r"names no end.*absolute --endtime.*ingest it.*then "
                                         r"sync"):
        sync(str(tmp_path / "s"), db, db, timedelta(days=4), NOW)  # type: ignore[arg-type]
    assert db.calls == []
