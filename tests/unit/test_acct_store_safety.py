"""The accounting store as root keeps it: never written, swept or locked through a link a user
planted; a manifest naming files outside the store, a store or manifest others could have
written, and a corrupt events file are refused with a message naming what to do, and nothing
in the store changes (`lemon scan --drain` drains from what these reads return)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gpuwarden.accounting.history import from_store, store_events
from gpuwarden.accounting.store.ingest import ingest
from gpuwarden.accounting.store.manifest import StoreError
from gpuwarden.core.errors import GpuwardenError
from tests.unit.test_acct_store import DAY, T0, export

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="chown to another uid needs root")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.mkdir()
    (v / "precious.parquet").write_text("someone's data")
    (v / "work.tmp").write_text("someone's temp")
    return v


def _store(tmp_path: Path) -> Path:
    s = tmp_path / "s"
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    ingest(s, [a])
    return s


def test_the_store_is_made_0750(tmp_path: Path) -> None:
    s = _store(tmp_path)
    assert (s.stat().st_mode & 0o777) == 0o750
    assert all(d.stat().st_mode & 0o777 == 0o750 for d in s.glob("day=*"))


def test_a_planted_day_link_is_never_written_through(tmp_path: Path, victim: Path) -> None:
    s = tmp_path / "s"
    s.mkdir(mode=0o750)
    (s / "day=2026-01-01").symlink_to(victim)  # the day the export's run ended
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    with pytest.raises(StoreError, match=r"day=2026-01-01 is a symbolic link.*remove it"):
        ingest(s, [a])
    assert sorted(os.listdir(victim)) == ["precious.parquet", "work.tmp"]
    assert not (s / "manifest.json").exists()


def test_sweep_skips_a_day_link_and_says_so(tmp_path: Path, victim: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    s = tmp_path / "s"
    s.mkdir(mode=0o750)
    (s / "day=1999-01-01").symlink_to(victim)  # a day no export writes: only the sweep meets it
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    with caplog.at_level(logging.WARNING):
        ingest(s, [a])
    assert sorted(os.listdir(victim)) == ["precious.parquet", "work.tmp"]
    assert "day=1999-01-01 is a symbolic link: left alone" in caplog.text
    assert from_store(str(s)).records == 1


def test_a_planted_lock_link_is_refused_and_its_target_not_made(tmp_path: Path,
                                                                 victim: Path) -> None:
    s = tmp_path / "s"
    s.mkdir(mode=0o750)
    (s / ".lock").symlink_to(victim / "lockvictim")
    a = export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])
    with pytest.raises(StoreError, match=r"\.lock"):
        ingest(s, [a])
    assert not (victim / "lockvictim").exists()


def test_a_store_others_can_write_is_refused(tmp_path: Path, victim: Path) -> None:
    s = _store(tmp_path)
    os.chmod(s, 0o1777)
    a = export(tmp_path / "b.json", T0 + DAY, T0 + 2 * DAY, [T0 + DAY + 100])
    with pytest.raises(StoreError, match=r"writable by group or others.*chmod go-w"):
        ingest(s, [a])
    with pytest.raises(StoreError, match=r"writable by group or others.*chmod go-w"):
        from_store(str(s))


@pytest.mark.parametrize("files,events", [
    (["../../../../etc/hostname"], None),
    (["/etc/hostname"], None),
    (["day=2026-01-01/../../x.parquet"], None),
    (["day=2026-01-01/.hidden.parquet"], None),
    (["day=2026-01-01/a.json"], None),
    (None, "../../../../etc/passwd"),
    (None, "/etc/passwd"),
    (None, "day=2026-01-01/events-1.parquet"),
])
def test_a_manifest_naming_a_file_outside_the_store_is_refused(
        tmp_path: Path, files: list[str] | None, events: str | None) -> None:
    s = _store(tmp_path)
    doc = json.loads((s / "manifest.json").read_text())
    if files is not None:
        doc["exports"][0]["files"] = files
    if events is not None:
        doc["events"] = events
    (s / "manifest.json").write_text(json.dumps(doc))
    bad = files[0] if files is not None else events
    with pytest.raises(StoreError, match=r"manifest\.json names .* not a file of the store"
                                         r".*new store") as got:
        from_store(str(s))
    assert repr(bad)[1:-1] in str(got.value)
    with pytest.raises(StoreError, match="not a file of the store"):
        ingest(s, [export(tmp_path / "b.json", T0 + DAY, T0 + 2 * DAY, [T0 + DAY + 5])])


@needs_root
def test_a_store_of_another_user_is_refused(tmp_path: Path) -> None:
    s = _store(tmp_path)
    os.chown(s, 4242, 4242)
    with pytest.raises(StoreError, match=r"owned by uid 4242.*chown"):
        from_store(str(s))
    with pytest.raises(StoreError, match=r"owned by uid 4242.*chown"):
        store_events(str(s))


@needs_root
def test_a_manifest_of_another_user_or_writable_by_others_is_refused(tmp_path: Path) -> None:
    s = _store(tmp_path)
    os.chown(s / "manifest.json", 4242, 4242)
    with pytest.raises(StoreError, match=r"manifest\.json is owned by uid 4242"):
        from_store(str(s))
    os.chown(s / "manifest.json", 0, 0)
    os.chmod(s / "manifest.json", 0o666)
    with pytest.raises(StoreError, match=r"manifest\.json is writable by group or others"):
        from_store(str(s))


def test_a_manifest_link_is_refused(tmp_path: Path) -> None:
    s = _store(tmp_path)
    os.replace(s / "manifest.json", tmp_path / "elsewhere.json")
    (s / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(StoreError, match=r"manifest\.json.*link"):
        from_store(str(s))


def test_a_data_file_link_is_refused(tmp_path: Path) -> None:
    s = _store(tmp_path)
    (f,) = s.glob("day=*/*.parquet")
    os.replace(f, tmp_path / "moved.parquet")
    f.symlink_to(tmp_path / "moved.parquet")
    with pytest.raises(StoreError, match=r"is not a regular file.*link"):
        from_store(str(s))


def test_a_rollup_directory_link_is_refused_and_never_written_through(
        tmp_path: Path, victim: Path) -> None:
    s = _store(tmp_path)
    os.replace(s / "rollup", tmp_path / "moved")
    (s / "rollup").symlink_to(victim)
    with pytest.raises(StoreError, match=r"rollup is not a directory.*link"):
        from_store(str(s))
    b = export(tmp_path / "b.json", T0 + DAY, T0 + 2 * DAY, [T0 + DAY + 5])
    with pytest.raises(StoreError, match=r"rollup is a symbolic link.*remove it"):
        ingest(s, [b])
    assert sorted(os.listdir(victim)) == ["precious.parquet", "work.tmp"]


def test_a_missing_rollup_is_a_clear_error(tmp_path: Path) -> None:
    s = _store(tmp_path)
    (f,) = s.glob("rollup/day=*/*.parquet")
    f.unlink()
    with pytest.raises(StoreError, match=r"rollup/day=2026-01-01/.*missing"):
        from_store(str(s))


def _events_store(tmp_path: Path) -> Path:
    s = tmp_path / "s"
    ev = tmp_path / "events.txt"
    ev.write_text("c|n01|2026-01-01T03:00:00|2026-01-01T04:00:00|DRAIN|gpuwarden: xid|root\n")
    from gpuwarden.accounting.history import read_events
    ingest(s, [export(tmp_path / "a.json", T0, T0 + DAY, [T0 + 100])],
           events=read_events(str(ev)))
    return s


def test_a_corrupt_events_file_is_a_clear_error(tmp_path: Path) -> None:
    s = _events_store(tmp_path)
    (f,) = s.glob("events-*.parquet")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    for read in (lambda: store_events(str(s)), lambda: from_store(str(s))):
        with pytest.raises(GpuwardenError, match=r"events-.*cannot be read.*new store"):
            read()


def test_a_forged_events_file_is_a_clear_error(tmp_path: Path) -> None:
    import polars as pl
    s = _events_store(tmp_path)
    (f,) = s.glob("events-*.parquet")
    pl.DataFrame({"node": [1, 2]}).write_parquet(f)
    with pytest.raises(StoreError, match=r"events-.*cannot be read.*new store"):
        store_events(str(s))


def test_report_and_lemon_scan_say_so_for_a_corrupt_events_file(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config.context import Context
    s = _events_store(tmp_path)
    (f,) = s.glob("events-*.parquet")
    f.write_bytes(b"PAR1 not really")
    for args in (["lemon", "scan", "--store", str(s)],
                 ["report", "--store", str(s), "-o", str(tmp_path / "r.html")]):
        got = CliRunner().invoke(cli, args, obj=Context())
        assert got.exit_code == 1, (args, got.output, got.exception)
        assert "cannot be read" in got.output and "Traceback" not in got.output
