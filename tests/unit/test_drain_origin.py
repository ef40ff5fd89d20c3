"""Which run of health gating set a drain is in its reason, so the report can tell the jobs
the prolog kept off a bad node from the failures only the epilog caught."""

from __future__ import annotations

import pytest

from gpuwarden.accounting.attribution import Attribution, Blame, event_time
from gpuwarden.report.tradeoffs import proactive_vs_reactive
from gpuwarden.slurm.models import REASON_PREFIX, NodeEvent
from gpuwarden.slurm.reasons import (
    HEALTH_TAG,
    drain_origin,
    health_reason,
    is_health_drain,
    origin_of,
)


@pytest.mark.parametrize(("context", "origin"), [
    ("prolog job 12", "prolog"), ("epilog job 9 (its launcher lost this node: c3)", "epilog"),
    ("health check", "periodic"), ("manual check", ""), ("something else", "")])
def test_each_run_of_health_gating_names_itself(context: str, origin: str) -> None:
    assert origin_of(context) == origin
    reason = f"{REASON_PREFIX} {health_reason('xid 79 on GPU 3', origin)}"
    assert is_health_drain(reason)
    assert drain_origin(reason) == origin
    # Slurm's own additions after the reason change nothing.
    assert drain_origin(reason + " : Not responding") == origin


def test_evidence_cannot_pass_for_an_origin() -> None:
    # Kernel text a user shaped comes after the origin word, never in its place.
    reason = f"{REASON_PREFIX} {health_reason('prolog: fake', 'periodic')}"
    assert drain_origin(reason) == "periodic"
    # A drain from before reasons carried the word: its evidence is not read as one.
    old = f"{REASON_PREFIX} {health_reason('xid 79 on GPU 3: prolog: x')}"
    assert drain_origin(old) == ""
    # An operator's drain is nobody's health drain, whatever it says.
    assert drain_origin("gpuwarden: prolog: by hand") == ""
    assert drain_origin("prolog: x [health]") == ""


def test_the_reason_keeps_its_tag_at_any_length() -> None:
    reason = f"{REASON_PREFIX} {health_reason('x' * 500, 'epilog')}"
    assert len(reason) <= 200 and reason.endswith(f" {HEALTH_TAG}")
    assert drain_origin(reason) == "epilog"
    with pytest.raises(ValueError, match="origin"):
        health_reason("x", "cron")


def _drain(node: str, at: str, origin: str) -> NodeEvent:
    return NodeEvent("c", node, at, "Unknown", "DRAIN",
                     f"{REASON_PREFIX} {health_reason('xid 79 on GPU 0', origin)}", "root")


def test_the_report_counts_prolog_refusals_and_epilog_catches() -> None:
    events = [_drain("n1", "2026-11-01T00:10:00", "prolog"),
              _drain("n2", "2026-11-01T00:20:00", "prolog"),
              _drain("n3", "2026-11-01T00:30:00", "epilog"),
              _drain("n4", "2026-11-01T00:40:00", "periodic"),
              _drain("n5", "2026-11-01T00:50:00", "")]
    # A run on n3 failed at 00:29: the epilog's drain a minute later is the only catch.
    failed = event_time("2026-11-01T00:29:00")
    assert failed is not None
    att = Attribution(blames=[Blame("n3", 1.0, 42, failed, "FAILED", 1, True, failed - 600)],
                      first_start=0.0, last_end=4e9)
    t = proactive_vs_reactive(att, events, 3600.0)
    got = {f.label: f.value for f in t.figures}
    assert got["prolog drains (each kept a starting job off a bad node)"] == 2
    assert got["drains by the epilog (after a job on the node)"] == 1
    assert got["drains by the periodic check"] == 1
    assert got["drains whose reason names no check (before gpuwarden named it)"] == 1
    assert got["failures only the epilog caught (epilog drains with a failed run)"] == 1
    assert got["drains that came with a failed run (the failure came first)"] == 1
    assert got["health-gating drains (the MTTF section's node failures)"] == 5
