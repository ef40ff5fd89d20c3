"""Heartbeats over real UDP: who counts, and how soon a silent or hung rank is seen."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator

import pytest

from gpuwarden.ckpt import beat
from gpuwarden.ckpt.beat import Beat, Beater
from gpuwarden.launch import decide
from gpuwarden.launch.decide import Layout, ProgressWatch, Verdict
from gpuwarden.launch.heartbeat import BeatTable, UdpReceiver
from gpuwarden.launch.settings import LaunchSettings

BEAT_S = 0.02


def wait_for(what: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until ``what`` held; fails the test at ``timeout``."""
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < timeout, "state not reached in time"
        time.sleep(0.005)
    return time.monotonic() - start


@pytest.fixture
def table() -> Iterator[BeatTable]:
    t = BeatTable("42")
    t.begin(1, 2)
    rx = UdpReceiver(t, host="127.0.0.1")
    t.port = rx.port  # type: ignore[attr-defined]
    yield t
    rx.stop()


def beater(t: BeatTable, rank: int, token: bytes | None = None, job: str = "42",
           gen: int = 1) -> Beater:
    return Beater(("127.0.0.1", t.port), token or t.token, job, gen, rank,  # type: ignore[attr-defined]
                  f"node{rank}", "3", BEAT_S)


def test_beats_with_the_launchers_token_count(table: BeatTable) -> None:
    b = beater(table, 0)
    b.progress(7)
    wait_for(lambda: table.views()[0].progress == 7)
    v = table.views()[0]
    assert (v.host, v.done) == ("node0", False)
    assert table.step_id() == "3"  # what the launcher passes to scancel
    b.stop()


def test_a_forged_beat_from_another_job_is_refused(table: BeatTable) -> None:
    # Another job's launcher has its own token; this job's is in no file and in no
    # environment but this step's.
    forger = beater(table, 1, token=secrets.token_bytes(32))
    wait_for(lambda: table.refused >= 3)
    assert table.views()[1].last is None
    forger.stop()


def test_a_replayed_beat_of_another_job_or_launch_does_not_count() -> None:
    t = BeatTable("42")
    t.begin(2, 2)
    genuine = beat.encode(t.token, Beat("42", 2, 0, "n0", "1", 5, 3, False, 0.0))
    assert t.offer(genuine) is None
    assert t.offer(genuine) is not None  # the same sequence number again: a replay
    assert "job" in (t.offer(beat.encode(t.token, Beat("43", 2, 0, "n0", "1", 9, 3, False,
                                                       0.0))) or "")
    old = beat.encode(t.token, Beat("42", 1, 1, "n1", "0", 1, 3, False, 0.0))
    assert "launch 1" in (t.offer(old) or "")  # the previous launch's ranks, still ending
    assert t.views()[1].last is None
    assert "MAC" in (t.offer(genuine[:-1] + b"9") or "")


def test_a_silent_rank_is_lost_within_the_deadline(table: BeatTable) -> None:
    s = LaunchSettings(beat_s=BEAT_S, deadline_s=0.5, start_s=5, hang_s=0)
    lay = Layout(("node0", "node1"), ("node2",))
    alive, dying = beater(table, 0), beater(table, 1)
    wait_for(lambda: all(v.last is not None for v in table.views()))
    started = time.monotonic()
    dying.stop()  # its node is gone: no beat, no goodbye

    def verdict() -> Verdict:
        return decide.judge(table.views(), lay, 0, time.monotonic(), s, ProgressWatch(), None)
    took = wait_for(lambda: verdict().kind == "lost")
    got = verdict()
    assert [(x.rank, x.node) for x in got.lost] == [(1, "node1")]
    assert s.deadline_s - 2 * BEAT_S <= took <= s.deadline_s + 0.5
    assert time.monotonic() - started < 2
    alive.stop()


def test_a_hung_job_is_seen_while_every_rank_beats(table: BeatTable) -> None:
    s = LaunchSettings(beat_s=BEAT_S, deadline_s=0.5, start_s=5, hang_s=0.6)
    lay = Layout(("node0", "node1"), ())
    ranks = [beater(table, 0), beater(table, 1)]
    watch = ProgressWatch()
    watch.begin(time.monotonic())
    for b in ranks:
        b.progress(4)  # then stuck, e.g. in a collective that never completes

    def verdict() -> Verdict:
        now = time.monotonic()
        watch.see(table.views(), now)
        return decide.judge(table.views(), lay, 0, now, s, watch, None)
    wait_for(lambda: verdict().kind == "running" and watch.value == 4)
    took = wait_for(lambda: verdict().kind != "running")
    assert verdict().kind == "hung"
    assert 0.6 <= took <= 1.5
    for b in ranks:
        b.stop()


def test_a_finishing_rank_says_so_and_its_silence_then_costs_nothing(table: BeatTable) -> None:
    b = beater(table, 0)
    b.done()
    wait_for(lambda: table.views()[0].done)
    b.stop()


def test_the_rank_side_starts_only_under_the_launcher(caplog: pytest.LogCaptureFixture) -> None:
    assert beat.from_env({}, "1", 0, "n0", "0") is None
    bad = {beat.ENV_ADDR: "host:1", beat.ENV_TOKEN: "zz", beat.ENV_GEN: "1"}
    assert beat.from_env(bad, "1", 0, "n0", "0") is None
    assert "no heartbeats" in caplog.text
    t = BeatTable("1")
    t.begin(1, 1)
    good = t.env("127.0.0.1:9", 0.5)
    b = beat.from_env(good, "1", 0, "n0", "0")
    assert b is not None and b.every_s == 0.5
    b.stop()
