"""Prologs, epilogs and the periodic check save verdicts side by side (Slurm runs them
concurrently): the fast path's summary must always be the summary of the JSON on disk, or a
job could start on an OK summary while the stored verdict is CRITICAL."""

from __future__ import annotations

import json
import marshal
import threading
import time
from pathlib import Path

import pytest

from gpuwarden.health import fastgate, store
from gpuwarden.health.model import CheckResult, Status, Verdict


def test_a_save_paused_between_json_and_summary_is_not_overtaken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    real = store.atomic_write
    a_paused, b_started = threading.Event(), threading.Event()
    writers: dict[str, threading.Thread] = {}

    def paused(directory: str, name: str, data: bytes, mode: int = 0o600) -> None:
        if name == store.FAST_SUMMARY and threading.current_thread().name == "A":
            # A is descheduled here; B gets every chance to finish its whole save meanwhile.
            a_paused.set()
            assert b_started.wait(10)
            writers["B"].join(0.5)
        real(directory, name, data, mode)

    monkeypatch.setattr(store, "atomic_write", paused)
    now = time.time()
    ok = Verdict("n1", now, "health", (CheckResult("gpu", Status.OK, "fine"),))
    bad = Verdict("n1", now + 1, "health",
                  (CheckResult("gpu", Status.CRITICAL, "xid 79", 0, "xid 79"),))
    s = store.Store(str(state))

    def b() -> None:
        b_started.set()
        s.save_verdict(bad)

    writers["A"] = threading.Thread(target=s.save_verdict, args=(ok,), name="A")
    writers["B"] = threading.Thread(target=b, name="B")
    writers["A"].start()
    assert a_paused.wait(10)  # A has written its JSON, not yet its summary
    writers["B"].start()
    for t in writers.values():
        t.join(20)
    doc = json.loads((state / store.Store.VERDICT).read_text())
    summary = marshal.loads((state / store.FAST_SUMMARY).read_bytes())
    assert summary["status"] == doc["status"] and summary["at"] == doc["at"]
    if doc["status"] != "OK":
        assert not isinstance(fastgate._verdict(
            {"state_dir": str(state), "verdict_max_age_s": 600}, "n1", time.time()), dict)


def test_a_save_that_cannot_take_the_lock_leaves_no_summary_to_trust(tmp_path: Path) -> None:
    """The new verdict is lost then (and reported); the old OK summary must not outlive it."""
    state = tmp_path / "state"
    s = store.Store(str(state))
    now = time.time()
    s.save_verdict(Verdict("n1", now, "health", (CheckResult("gpu", Status.OK, "fine"),)))
    assert (state / store.FAST_SUMMARY).exists()
    (state / store.Store.LOCK).unlink()
    (state / store.Store.LOCK).mkdir()
    bad = Verdict("n1", now + 1, "health",
                  (CheckResult("gpu", Status.CRITICAL, "xid 79", 0, "xid 79"),))
    with pytest.raises(store.StateWriteError, match=store.Store.LOCK):
        s.save_verdict(bad)
    assert not (state / store.FAST_SUMMARY).exists()
    assert not isinstance(fastgate._verdict(
        {"state_dir": str(state), "verdict_max_age_s": 600}, "n1", time.time()), dict)


def _fast(state: Path) -> object:
    return fastgate._verdict({"state_dir": str(state), "verdict_max_age_s": 600}, "n1",
                             time.time())


def test_a_verdict_whose_checks_started_earlier_never_replaces_a_later_one(
        tmp_path: Path) -> None:
    """An epilog whose checks began before a fault, saving after the periodic check stored
    the fault's CRITICAL, must not put an OK back in front of prologs."""
    state = tmp_path / "state"
    s = store.Store(str(state))
    now, mono = time.time(), time.monotonic()
    bad = Verdict("n1", now, "health check",
                  (CheckResult("gpu", Status.CRITICAL, "ecc", 0, "ecc uncorrectable"),))
    assert s.save_verdict(bad, started_mono=mono)
    ok = Verdict("n1", now, "epilog job 7", (CheckResult("gpu", Status.OK, "fine"),))
    assert not s.save_verdict(ok, started_mono=mono - 5)
    kept = s.load_stored()
    assert kept is not None and kept[0].status == Status.CRITICAL
    # The summary removed before the lock is back, and it is the CRITICAL one's.
    assert (state / store.FAST_SUMMARY).exists()
    assert not isinstance(_fast(state), dict)
    # A verdict whose checks started later does replace it.
    assert s.save_verdict(ok, started_mono=mono + 5)
    kept = s.load_stored()
    assert kept is not None and kept[0].status == Status.OK
    assert isinstance(_fast(state), dict)


def test_a_verdict_of_an_earlier_boot_is_replaced_whatever_its_clock(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    state = tmp_path / "state"
    s = store.Store(str(state))
    now = time.time()
    monkeypatch.setattr(store, "boot_id", lambda: "boot-a")
    assert s.save_verdict(Verdict("n1", now, "health check",
                                  (CheckResult("gpu", Status.CRITICAL, "x", 0, "x"),)),
                          started_mono=1e9)
    monkeypatch.setattr(store, "boot_id", lambda: "boot-b")
    assert s.save_verdict(Verdict("n1", now + 1, "health check",
                                  (CheckResult("gpu", Status.OK, "fine"),)), started_mono=3.0)
    kept = s.load_stored()
    assert kept is not None and kept[0].status == Status.OK


def _crit(now: float, context: str = "health check") -> Verdict:
    return Verdict("n1", now, context, (CheckResult("gpu", Status.CRITICAL, "ecc", 1, "ecc"),))


def _ok(now: float, context: str) -> Verdict:
    return Verdict("n1", now, context, (CheckResult("gpu", Status.OK, "fine"),))


def test_worse_news_is_stored_whichever_checks_started_first(tmp_path: Path) -> None:
    """A job's prolog (its GPUs only) starts while the 60 s periodic check runs, and saves
    first. The periodic check's CRITICAL, on another GPU, must still be stored, and reach the
    textfile."""
    state, prom = tmp_path / "state", tmp_path / "prom"
    s = store.Store(str(state), str(prom))
    now, mono = time.time(), time.monotonic()
    assert s.save_verdict(_ok(now, "prolog job 9"), complete=False, gpus={0},
                          started_mono=mono - 30)
    assert s.save_verdict(_crit(now), started_mono=mono - 60)
    kept = s.load_stored()
    assert kept is not None and kept[0].status == Status.CRITICAL and kept[1]
    assert "gpuwarden_health_status{node=\"n1\"} 2" in (prom / store.Store.PROM).read_text()


def test_an_ok_from_checks_that_overlapped_a_critical_is_not_stored(tmp_path: Path) -> None:
    """A full prolog starts 10 s into the periodic check and reads the GPUs before the
    fault; the periodic check finds it and saves first. The prolog's OK must not hide it."""
    state = tmp_path / "state"
    s = store.Store(str(state))
    now, mono = time.time(), time.monotonic()
    assert s.save_verdict(_crit(now), started_mono=mono - 60)
    assert not s.save_verdict(_ok(now, "prolog job 9"), started_mono=mono - 50)
    kept = s.load_stored()
    assert kept is not None and kept[0].status == Status.CRITICAL
    assert not isinstance(_fast(state), dict)


def test_a_stored_verdict_dated_in_the_future_blocks_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    s = store.Store(str(state))
    now, mono = time.time(), time.monotonic()
    assert s.save_verdict(_crit(now), started_mono=mono)
    doc = json.loads((state / store.Store.VERDICT).read_text())
    doc[store.MONO] = mono + 1e6  # only a different clock could have written this
    store.atomic_write(str(state), store.Store.VERDICT, json.dumps(doc).encode())
    assert s.save_verdict(_ok(now, "health check"), started_mono=mono + 1)
    kept = s.load_stored()
    assert kept is not None and kept[0].status == Status.OK


def test_the_same_news_from_checks_that_started_earlier_keeps_the_later_look(
        tmp_path: Path) -> None:
    """The periodic check finds a fault during a job and drains (slowly: slurmctld is busy);
    the job ends, the epilog runs every check, finds the same fault and saves first. The
    periodic check's save after it must not hide the epilog's verdict, which says why it
    looked (CI saw exactly this)."""
    state = tmp_path / "state"
    s = store.Store(str(state))
    now, mono = time.time(), time.monotonic()
    assert s.save_verdict(_crit(now, "epilog job 3 (its launcher lost this node: rank 2)"),
                          started_mono=mono - 2)
    assert not s.save_verdict(_crit(now - 20), started_mono=mono - 25)
    kept = s.load_stored()
    assert kept is not None and kept[0].context.startswith("epilog job 3")
    assert not isinstance(_fast(state), dict)
    # A later periodic check's verdict, the same news, does replace it.
    assert s.save_verdict(_crit(now + 1), started_mono=mono - 1)
    kept = s.load_stored()
    assert kept is not None and kept[0].context == "health check"


def test_a_partial_later_look_does_not_keep_out_a_whole_node_verdict(tmp_path: Path) -> None:
    """A prolog that checked its job's GPUs only (stored partial) starts during the periodic
    check; the periodic check's whole-node OK, saved after it, still lands (and reaches the
    textfile and the prologs' fast path)."""
    state, prom = tmp_path / "state", tmp_path / "prom"
    s = store.Store(str(state), str(prom))
    now, mono = time.time(), time.monotonic()
    assert s.save_verdict(_ok(now, "prolog job 9"), complete=False, gpus={0},
                          started_mono=mono - 5)
    assert s.save_verdict(_ok(now, "health check"), started_mono=mono - 30)
    kept = s.load_stored()
    assert kept is not None and kept[0].context == "health check" and kept[1]
    assert isinstance(_fast(state), dict)
