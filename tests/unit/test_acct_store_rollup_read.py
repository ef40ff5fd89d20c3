"""The store's rollups are summed again a few files at a time (`rollup.summed`): a year's 360
files read at once held 1.5-2.4 GiB at their peak. The sums are those of every stored row."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import polars as pl

from gpuwarden.accounting.store import rollup, scan, snapshot
from gpuwarden.accounting.store.ingest import ingest
from tests.unit.test_acct_store import DAY, T0, export


def _store(tmp_path: Path, days: int) -> snapshot.Snapshot:
    paths = [export(tmp_path / f"d{d}.json", T0 + d * DAY, T0 + (d + 1) * DAY,
                    [T0 + d * DAY + 100 * (k + 1) for k in range(d + 1)]) for d in range(days)]
    ingest(tmp_path / "s", paths, workers=1)
    return snapshot.opened(tmp_path / "s")


def _sorted(df: pl.DataFrame) -> pl.DataFrame:
    return df.sort(df.columns, nulls_last=True)


def test_rollups_are_read_a_few_files_at_a_time_with_the_sums_of_every_row(
        tmp_path: Path) -> None:
    snap = _store(tmp_path, 5)
    read: list[int] = []
    whole = rollup.scan

    def counted(paths: list[str]) -> pl.LazyFrame:
        read.append(len(paths))
        return whole(paths)
    with mock.patch.object(rollup, "PER_READ", 2, create=True), mock.patch.object(rollup, "scan", counted):
        got = scan.rolled(snap.files, snap.rollups).collect()
    assert read == [2, 2, 1]
    rows = scan.rows(snap.files).drop("rid").collect()
    assert _sorted(got).equals(_sorted(rollup.of(rows)))
    for part in (rollup.lists, rollup.sources, rollup.cells):  # as the readers group them
        assert _sorted(part(got.lazy()).collect()).equals(
            _sorted(part(rollup.scan(list(snap.rollups))).collect()))
