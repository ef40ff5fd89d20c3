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
