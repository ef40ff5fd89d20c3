"""The accounting store's own promises: a store of another schema version is refused, exports
whose windows overlap are refused with nothing written, a changed export is replaced, an
unchanged one skipped, and a crash before the manifest leaves the previous store readable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwarden.accounting.history import HistoryError, from_store
from gpuwarden.accounting.store import files, manifest
from gpuwarden.accounting.store.ingest import ingest
from gpuwarden.accounting.store.manifest import StoreError
from gpuwarden.fleet.simulate import sacct_meta

T0 = 1_767_225_600
DAY = 86_400


def _job(i: int, end: int, state: str = "COMPLETED") -> dict[str, object]:
    return {"job_id": i, "name": "j", "user": "ann", "partition": "gpu",
            "state": {"current": [state], "reason": "None"}, "nodes": "n[01-02]",
            "allocation_nodes": 2, "failed_node": "", "submit_line": "sbatch a.sh",
            "restart_cnt": 0, "time": {"submission": end - 700, "start": end - 600, "end": end},
            "exit_code": {"return_code": {"set": True, "infinite": False, "number": 0},
                          "signal": {"id": {"set": False, "infinite": False, "number": 0}}},
            "tres": {"allocated": [{"type": "gres", "name": "gpu", "id": 1001, "count": 16}]}}


def export(path: Path, lo: int, hi: int, ends: list[int]) -> str:
    path.write_text(json.dumps({"jobs": [_job(i + 1, e) for i, e in enumerate(ends)],
                                "meta": sacct_meta(lo, hi), "errors": [], "warnings": []}))
    return str(path)


def test_a_run_is_stored_once_in_the_day_it_ended(tmp_path: Path) -> None:
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100, T0 + DAY + 50])  # 2nd: next day's
    b = export(tmp_path / "b.json", T0 + DAY, T0 + 2 * DAY, [T0 + DAY + 50])
    got = ingest(tmp_path / "s", [a, b])
    assert got.rows == 2
    days = sorted(p.parent.name for p in (tmp_path / "s").glob("day=*/*.parquet"))
    assert days == ["day=2026-01-01", "day=2026-01-02"]
    assert from_store(str(tmp_path / "s")).records == 2


def test_unchanged_is_skipped_and_changed_is_replaced(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    ingest(tmp_path / "s", [a])
    assert ingest(tmp_path / "s", [a]).unchanged == (str(tmp_path / "a.json"),)
    export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100, T0 + 200, T0 + 300])  # re-exported
    got = ingest(tmp_path / "s", [a])
    assert got.replaced == (str(tmp_path / "a.json"),)
    assert "changed since it was ingested: its rows are replaced" in caplog.text
    assert from_store(str(tmp_path / "s")).records == 3
    assert len(list((tmp_path / "s").glob("day=*/*.parquet"))) == 1  # the old file went


def test_overlapping_exports_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    ingest(tmp_path / "s", [a])
    before = (tmp_path / "s" / "manifest.json").read_bytes()
    week = export(tmp_path / "week.json", T0, T0 + 7 * DAY, [T0 + 100, T0 + 2 * DAY])
    with pytest.raises(StoreError, match="overlap.*nothing was ingested"):
        ingest(tmp_path / "s", [week])
    assert (tmp_path / "s" / "manifest.json").read_bytes() == before
    assert len(list((tmp_path / "s").glob("day=*/*.parquet"))) == 1


def test_another_schema_version_is_refused(tmp_path: Path) -> None:
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    ingest(tmp_path / "s", [a])
    doc = json.loads((tmp_path / "s" / "manifest.json").read_text())
    doc["schema"] = manifest.VERSION + 1
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=f"schema version {manifest.VERSION + 1}; this "
                                         f"gpuwarden reads version {manifest.VERSION}"):
        from_store(str(tmp_path / "s"))
    with pytest.raises(StoreError, match="schema version"):
        ingest(tmp_path / "s", [a])


def test_each_runs_file_has_its_rollup_and_the_sweep_keeps_them_together(
        tmp_path: Path) -> None:
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100, T0 + DAY + 50])
    b = export(tmp_path / "b.json", T0 + DAY, T0 + 2 * DAY, [T0 + DAY + 50])
    ingest(tmp_path / "s", [a, b])
    export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100, T0 + 200])  # re-exported: replaced
    ingest(tmp_path / "s", [a])

    def names(glob: str) -> list[str]:
        return sorted(str(p.relative_to(tmp_path / "s")) for p in (tmp_path / "s").glob(glob))
    assert names("rollup/day=*/*.parquet") == [f"rollup/{n}" for n in names("day=*/*.parquet")]
    assert len(names("day=*/*.parquet")) == 2
    assert from_store(str(tmp_path / "s")).records == 3


def _as_version_1(store: Path) -> None:
    """``store`` as a version-1 writer left it: no rollups."""
    for f in store.glob("rollup/day=*/*.parquet"):
        f.unlink()
    doc = json.loads((store / "manifest.json").read_text())
    doc["schema"] = 1
    (store / "manifest.json").write_text(json.dumps(doc))


def test_a_version_1_store_is_refused_by_readers_and_upgraded_by_a_writer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100, T0 + 200])
    ingest(tmp_path / "s", [a])
    before = from_store(str(tmp_path / "s"))
    _as_version_1(tmp_path / "s")
    with pytest.raises(StoreError, match="schema version 1, written before the rollups.*"
                                         "upgrade it in place by running `gpuwarden "
                                         "accounting sync` or `gpuwarden accounting ingest`"):
        from_store(str(tmp_path / "s"))
    got = ingest(tmp_path / "s", [a])  # the same export: unchanged, the store upgraded
    assert got.unchanged == (str(tmp_path / "a.json"),)
    assert "upgraded from schema version 1 to 2 (1 runs files' rollups written)" in caplog.text
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["schema"] == 2
    after = from_store(str(tmp_path / "s"))
    assert after.attribution.exposure == before.attribution.exposure
    assert after.records == before.records == 2


def test_a_crash_before_the_manifest_leaves_the_previous_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    ingest(tmp_path / "s", [a])
    b = export(tmp_path / "b.json", T0 + DAY, T0 + 2 * DAY, [T0 + DAY + 5, T0 + DAY + 9])

    def crash(*_: object) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(manifest, "write_at", crash)
    # A crash, not an error ingest cleans up after: b's data files stay on disk.
    monkeypatch.setattr(files, "remove", lambda *_: None)
    with pytest.raises(OSError):
        ingest(tmp_path / "s", [b])
    monkeypatch.undo()
    assert len(list((tmp_path / "s").glob("day=*/*.parquet"))) == 2  # a's and b's
    assert from_store(str(tmp_path / "s")).records == 1  # b's files are not read
    assert ingest(tmp_path / "s", [a, b]).added == (str(tmp_path / "b.json"),)
    assert from_store(str(tmp_path / "s")).records == 3


def test_an_empty_store_says_how_to_fill_it(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="accounting ingest --from EXPORTS"):
        from_store(str(tmp_path / "none"))


BUSY_POLARS = """
import sys, threading, time
import polars as pl
from gpuwarden.accounting.store.ingest import ingest

def busy():
    df = pl.DataFrame({"a": list(range(1_000_000)), "b": list(range(1_000_000))})
    while True:
        df.group_by(pl.col("a") % 1000).agg(pl.col("b").sum())

threading.Thread(target=busy, daemon=True).start()
time.sleep(0.5)
print(ingest(sys.argv[1], sys.argv[2:], workers=2).rows)
"""


def test_ingest_with_workers_in_a_process_already_running_polars(tmp_path: Path) -> None:
    """Forked while polars' threads were busy, the workers hung for good (CI, the golden
    test's fixture after other store tests in one worker): they are spawned, not forked."""
    paths = [export(tmp_path / f"d{i}.json", T0 + i * DAY, T0 + (i + 1) * DAY,
                    [T0 + i * DAY + 100]) for i in range(3)]
    proc = subprocess.Popen([sys.executable, "-c", BUSY_POLARS, str(tmp_path / "st"), *paths],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        out, err = proc.communicate(timeout=50)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its hung workers too
        proc.communicate()
        pytest.fail("ingest's workers hung")
    assert proc.returncode == 0, err[-2000:]
    assert out.split()[-1] == "3"


@pytest.mark.parametrize(("field", "value", "named"), [
    ("allocation_nodes", 3_000_000_000, "allocation_nodes"),
    ("restart_cnt", 2_200_000_000, "restart_cnt"),
    ("tres", {"allocated": [{"type": "gres", "name": "gpu", "id": 1001,
                             "count": 4_000_000_000}]}, "gres/gpu"),
])
def test_a_count_the_store_cannot_hold_is_a_malformed_record_named(
        tmp_path: Path, field: str, value: object, named: str) -> None:
    """A count under Slurm's placeholder but past the store's 32-bit column (an export edited
    by hand, or a broken one) is that record's problem, named; the export's other records are
    stored (it was a polars error that stopped the whole ingest)."""
    bad = _job(1, T0 + 100)
    bad[field] = value
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"jobs": [bad, _job(2, T0 + 200)],
                                "meta": sacct_meta(T0, T0 + DAY), "errors": [], "warnings": []}))
    got = ingest(tmp_path / "s", [str(path)])
    assert got.rows == 1
    (entry,) = got.store.exports
    assert entry.malformed == 1
    assert "job 1" in entry.first_bad and named in entry.first_bad, entry.first_bad
    assert "store" in entry.first_bad
