"""Progress lines for the demo's and the image build's long waits, and the demo's pure parts."""

from __future__ import annotations

import io
import json

import pytest

from devcluster import demo
from devcluster.harness import job_status
from devcluster.progress import Ticker, Wait, waiting
from gpuwarden.slurm.models import Job


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ticker(tty: bool, expected: float | None = 45) -> tuple[Ticker, io.StringIO, Clock]:
    clock, out = Clock(), io.StringIO()
    return Ticker(Wait("job 7: requeue", expected, clock(), tty), out, clock), out, clock


def test_a_log_gets_what_it_waits_for_at_once_then_a_line_every_ten_seconds() -> None:
    t, out, clock = ticker(tty=False)
    t.begin()
    for step in range(1, 26):  # the thread ticks once a second
        clock.now = 1000.0 + step
        t.tick()
    clock.now = 1026.4
    t.finish(ok=True)
    assert out.getvalue().splitlines() == [
        "job 7: requeue: 0 s (usually about 45 s)",
        "job 7: requeue: 10 s (usually about 45 s)",
        "job 7: requeue: 20 s (usually about 45 s)",
        "job 7: requeue: done in 26 s",
    ]


def screen(text: str) -> list[str]:
    """What a terminal shows after ``text``: "\r" returns to the line's start, characters
    overwrite, "\n" ends the line."""
    lines, cur, col = [], [], 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(cur).rstrip())
            cur, col = [], 0
        else:
            if col < len(cur):
                cur[col] = ch
            else:
                cur.append(ch)
            col += 1
    return [*lines, "".join(cur).rstrip()] if cur else lines


def test_a_terminal_sees_one_line_rewritten_in_place() -> None:
    t, out, clock = ticker(tty=True)
    t.note("job 7 PENDING (BeginTime)")
    t.begin()
    assert screen(out.getvalue()) == [
        "job 7: requeue: 0 s (usually about 45 s); job 7 PENDING (BeginTime)"]
    clock.now += 1
    t.note("")  # a shorter line must leave nothing of the longer one
    t.tick()
    assert screen(out.getvalue()) == ["job 7: requeue: 1 s (usually about 45 s)"]
    clock.now += 1
    t.finish(ok=True)
    assert screen(out.getvalue()) == ["job 7: requeue: done in 2 s"]
    assert out.getvalue().count("\n") == 1 and out.getvalue().endswith("done in 2 s\n")


def test_a_wait_far_past_its_usual_time_says_so() -> None:
    t, out, clock = ticker(tty=False, expected=40)
    clock.now += 75
    t.tick()
    assert "1 min" not in out.getvalue()  # under 2 minutes reads as seconds
    assert out.getvalue().strip() == "job 7: requeue: 75 s (usually about 40 s), longer than " \
                                      "usual, still waiting"
    clock.now += 60
    t.tick()
    assert "2 min 15 s" in out.getvalue().splitlines()[-1]


def test_a_wait_without_an_estimate_shows_elapsed_only() -> None:
    t, out, clock = ticker(tty=False, expected=None)
    clock.now += 12
    t.tick()
    assert out.getvalue().strip() == "job 7: requeue: 12 s"


def test_waiting_ends_its_line_and_says_when_the_body_failed() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), waiting("sacct", 5, stream=out, tty=False):
        raise RuntimeError("boom")
    lines = out.getvalue().splitlines()
    assert lines[0] == "sacct: 0 s (usually about 5 s)"
    assert lines[-1].startswith("sacct: stopped after")
    after = out.getvalue()
    with waiting("quick", 5, stream=out, tty=False) as w:
        w.note("seen")
    assert out.getvalue()[len(after):].splitlines()[-1] == "quick: done in 0 s"


def test_a_polled_job_reads_as_its_state_and_reason() -> None:
    pending = Job(job_id=12, name="x", user="alice", state=("PENDING",),
                  state_reason="BeginTime", partition="gpu", nodes="", num_nodes=1,
                  restart_count=1, exit_code=0, admin_comment="", comment="")
    assert job_status(12, pending) == "job 12 PENDING (BeginTime)"
    assert job_status(12, None) == "job 12: not known to slurmctld yet"


def test_long_command_output_is_cut_with_a_count_of_the_rest() -> None:
    text = "\n".join(f"line {i}" for i in range(30)) + "\n"
    lines = demo.shown(text, limit=18)
    assert lines[0] == "    line 0" and lines[17] == "    line 17"
    assert lines[-1] == "    ... (12 more lines)" and len(lines) == 19
    assert demo.shown("a\nb\n", limit=18) == ["    a", "    b"]


def test_the_scan_is_set_against_the_planted_lemons() -> None:
    scan = json.dumps({"records": 9, "nodes": [
        {"node": "n0001", "lemon": True}, {"node": "n0002", "lemon": True},
        {"node": "n0003", "lemon": False}, {"node": "n0009", "lemon": True}]})
    truth = json.dumps({"lemons": ["n0001", "n0002", "n0005"]})
    assert demo.detection(scan, truth) == (
        "The simulator planted 3 lemons (truth.json); the scan flagged 3: 2 of the 3, and 1 "
        "ordinary node(s) (n0009).")
    clean = json.dumps({"nodes": [{"node": "n0001", "lemon": True}]})
    assert demo.detection(clean, json.dumps({"lemons": ["n0001"]})).endswith(
        "1 of the 1, and no ordinary node.")
