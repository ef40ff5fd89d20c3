"""Deadlines that really fire, and state files that cannot be steered by a planted link."""

from __future__ import annotations

import errno
import json
import marshal
import os
import time
from pathlib import Path

import pytest

from gpuwarden.core.deadline import run_all
from gpuwarden.health import store as storemod
from gpuwarden.health.model import CheckResult, Status, Verdict
from gpuwarden.health.nodechecks import available_memory_mb, ib_port_result, mount_points
from gpuwarden.health.store import (
    StateDirError,
    StateWriteError,
    Store,
    fast_summary,
    prometheus,
)


def test_a_hung_check_times_out_and_the_others_still_answer() -> None:
    t0 = time.monotonic()
    # The hung check gets the short deadline under test; the others a generous one of their
    # own, so a loaded machine cannot make them time out too (they answer at once anyway).
    out = run_all({"hang": lambda: time.sleep(600), "quick": lambda: 42,
                   "boom": lambda: 1 / 0}, deadline_s=0.5, limits={"quick": 30, "boom": 30})
    assert time.monotonic() - t0 < 10  # not the 600 s the hung check would take
    assert out["hang"].timed_out
    assert out["quick"].value == 42
    assert "ZeroDivisionError" in out["boom"].error


def test_a_check_reading_a_fifo_is_abandoned(tmp_path: Path) -> None:
    fifo = tmp_path / "canary"
    os.mkfifo(fifo)
    out = run_all({"mount": lambda: fifo.read_text()}, deadline_s=0.3)
    assert out["mount"].timed_out


def verdict() -> Verdict:
    return Verdict("c1", 1.0e9, "health check", (
        CheckResult("gpu", Status.OK, "fine"),
        CheckResult("xid", Status.CRITICAL, "xid 79", 5, "xid 79 on GPU 5"),
    ))


def test_verdicts_round_trip_and_files_are_private(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "state"), str(tmp_path / "prom"))
    store.save_verdict(verdict())
    assert store.load_verdict() == verdict()
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "state" / "verdict.json").stat().st_mode & 0o777 == 0o600
    prom = (tmp_path / "prom" / "gpuwarden.prom").read_text()
    assert 'gpuwarden_health_status{node="c1"} 2' in prom
    assert 'gpuwarden_check_status{check="xid",gpu="5"} 2' in prom
    assert not [p for p in (tmp_path / "state").iterdir() if p.name.startswith(".")]


def good() -> Verdict:
    return Verdict("c1", 1.0e9, "health check", (CheckResult("gpu", Status.OK, "fine"),))


def test_the_fast_paths_summary_is_written_with_the_verdict_and_says_the_same(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    Store(str(state)).save_verdict(verdict(), fake_fp=[1, 2, 3, 4, 5])
    doc = json.loads((state / Store.VERDICT).read_text())
    summary = marshal.loads((state / Store.FAST).read_bytes())
    assert summary == fast_summary(doc)
    assert summary["results"] == ["OK", "CRITICAL"] and summary["fake_gpu_fp"] == [1, 2, 3, 4, 5]
    assert (state / Store.FAST).stat().st_mode & 0o777 == 0o600


def _failing(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    real = storemod.atomic_write

    def write(directory: str, n: str, data: bytes, mode: int = 0o600) -> None:
        if n == name:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(directory, n, data, mode)
    monkeypatch.setattr(storemod, "atomic_write", write)


@pytest.mark.parametrize("name", [Store.VERDICT, Store.FAST])
def test_no_summary_is_left_that_a_failed_save_made_older_than_the_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Whichever write fails (a full disk), the fast path must not go on trusting the last
    good summary once a newer, critical verdict was made: it finds none and runs the full way."""
    state = tmp_path / "state"
    Store(str(state)).save_verdict(good())
    assert (state / Store.FAST).exists()
    _failing(monkeypatch, name)
    with pytest.raises(StateWriteError, match=f"{state / name}: .*No space left"):
        Store(str(state)).save_verdict(verdict())
    assert not (state / Store.FAST).exists()
    assert not [p for p in state.iterdir() if p.name.startswith(".")]


def test_a_state_file_others_could_have_written_is_not_read(tmp_path: Path) -> None:
    state = tmp_path / "state"
    Store(str(state)).save_verdict(good())
    (state / Store.VERDICT).chmod(0o620)
    with pytest.raises(StateDirError, match="not ours alone"):
        Store(str(state)).load_verdict()


# (A linked or group-writable state directory itself: test_safefs.py.)


def test_a_planted_link_instead_of_the_verdict_is_not_followed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(verdict().to_json()))
    (state / "verdict.json").symlink_to(secret)
    with pytest.raises(OSError):
        Store(str(state)).load_verdict()


def test_a_corrupt_verdict_means_check_afresh(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "verdict.json").write_text("{half")
    assert Store(str(state)).load_verdict() is None


def test_prometheus_labels_are_escaped() -> None:
    v = Verdict('c"1', 1.0, "x", (CheckResult('mount:/a"b', Status.OK, "ok"),))
    assert 'check="mount:/a\\"b"' in prometheus(v)


def test_mountinfo_parsing_decodes_escapes() -> None:
    text = "36 35 98:0 / /fsx rw - ext4 /dev/x rw\n37 35 98:0 / /mnt/with\\040space rw - ext4 /d rw\n"
    assert mount_points(text) == {"/fsx", "/mnt/with space"}


def test_a_mount_point_with_a_non_ascii_name_is_found() -> None:
    """Reproduced: the "unicode_escape" codec read /mnt/données back as /mnt/donnÃ©es, so the
    mount check said "not mounted" (CRITICAL) for a mount that was there."""
    text = "38 35 98:0 / /mnt/donn\u00e9es\\134x\\040y rw - ext4 /d rw\n"
    assert mount_points(text) == {"/mnt/donn\u00e9es\\x y"}


def test_meminfo_and_ib_parsing() -> None:
    assert available_memory_mb("MemTotal: 100 kB\nMemAvailable: 2048000 kB\n") == 2000
    assert ib_port_result("mlx5_0:1", "4: ACTIVE", "200 Gb/sec (4X HDR)", 200).status == Status.OK
    down = ib_port_result("mlx5_0:1", "1: DOWN", "0", 200)
    assert down.status == Status.CRITICAL and down.evidence == "IB mlx5_0:1 down"
    slow = ib_port_result("mlx5_0:1", "4: ACTIVE", "100 Gb/sec (4X EDR)", 200)
    assert slow.status == Status.CRITICAL and "100 Gb/s" in slow.message


def test_a_fifo_instead_of_the_verdict_neither_blocks_nor_is_read(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(state / "verdict.json")
    t0 = time.monotonic()
    with pytest.raises(StateDirError, match="not a regular file"):
        Store(str(state)).load_verdict()
    assert time.monotonic() - t0 < 10  # a read of the FIFO would block forever


def test_reading_from_a_shared_writable_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(StateDirError, match="not a private directory"):
        Store(str(state)).load_counters()


def test_the_exit_is_not_held_up_by_an_abandoned_check() -> None:
    import subprocess
    import sys

    code = ("import time; from gpuwarden.core.deadline import run_all; "
            "print(run_all({'x': lambda: time.sleep(60)}, 0.2)['x'].timed_out)")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert res.stdout.strip() == "True" and time.monotonic() - t0 < 10
