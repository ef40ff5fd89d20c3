"""`accounting sync`: slurmdbd's windows since the last sync pulled into the store, a day per
call, a run stored once (in the window it ended in), the sync's end kept for the next one."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuwarden.accounting.history import from_store
from gpuwarden.accounting.store import manifest
from gpuwarden.accounting.store.manifest import StoreError
from gpuwarden.accounting.store.sync import sync
from gpuwarden.core.errors import SlurmError
from gpuwarden.slurm.models import AcctJob, NodeEvent
from gpuwarden.slurm.runner import CommandTimeoutError

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


def run(i: int, end: datetime, hours: float = 30) -> AcctJob:
    e = int(end.timestamp())
    return AcctJob(i, "j", "ann", "COMPLETED", "None", "gpu", "n[01-02]", 2, 16, 0, None,
                   e - int(hours * 3600) - 60, e - int(hours * 3600), e, 0)


def test_sync_pulls_each_run_once_and_goes_on_from_where_it_ended(tmp_path: Path) -> None:
    db = Slurmdbd([run(1, NOW - timedelta(hours=20)), run(2, NOW - timedelta(hours=1))])
    got = sync(str(tmp_path), db, db, timedelta(days=2), NOW)  # type: ignore[arg-type]
    assert len(db.calls) == 2 and got.rows == 2  # a day per call; the long run counted once
    assert from_store(str(tmp_path)).records == 2
    assert manifest.load(tmp_path).synced_to == NOW.timestamp()
    later = NOW + timedelta(hours=6)
    db.runs.append(run(3, later - timedelta(hours=2), hours=1))
    got = sync(str(tmp_path), db, db, timedelta(days=2), later)  # type: ignore[arg-type]
    assert db.calls[-1] == (NOW.strftime(FMT), later.strftime(FMT)) and got.rows == 1
    hist = from_store(str(tmp_path))
    assert hist.records == 3 and len(hist.events) == 1


def test_a_window_sacct_cannot_answer_is_read_as_halves(tmp_path: Path) -> None:
    db = Slurmdbd([run(1, NOW - timedelta(hours=3), hours=1)], slow_over=timedelta(hours=7))
    got = sync(str(tmp_path), db, db, timedelta(days=1), NOW)  # type: ignore[arg-type]
    assert got.rows == 1 and len(db.calls) == 1 + 2 + 4  # 24 h, 2 x 12 h, 4 x 6 h


def test_a_sync_over_an_ingested_export_is_refused(tmp_path: Path) -> None:
    from gpuwarden.accounting.store.ingest import ingest
    from tests.unit.test_acct_store import export
    day = int((NOW - timedelta(days=1)).timestamp()) // 86_400 * 86_400
    ingest(tmp_path / "s", [export(tmp_path / "a.json", day, day + 86_400, [day + 10])])
    db = Slurmdbd([])
    with pytest.raises(StoreError, match="overlap"):
        sync(str(tmp_path / "s"), db, db, timedelta(days=2), NOW)  # type: ignore[arg-type]
    assert db.calls == []
