"""The drain/resume state machine and the blast-radius cap, without Slurm."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuwarden.health import gate
from gpuwarden.health.model import CheckResult, Status, Verdict
from gpuwarden.slurm import drain
from gpuwarden.slurm.drain_cap import BlastRadius
from gpuwarden.slurm.models import Node
from tests.fakes import FakeSlurm

NOW = 1_800_000_000.0


def node(name: str, state: tuple[str, ...] = ("IDLE",), reason: str = "", comment: str = "",
         changed: float | None = None, boot: int | None = None, parts: tuple[str, ...] = ("gpu",)) -> Node:
    return Node(name, state, reason, "root" if reason else "", int(changed) if changed else None,
                parts, "gpu:h100:8", (), boot, comment)


def verdict(status: Status, evidence: str = "xid 79 on GPU 5") -> Verdict:
    return Verdict("c3", NOW, "test", (CheckResult("xid", status, evidence, 5, evidence),))


def test_critical_on_a_healthy_node_drains_with_the_evidence() -> None:
    d = gate.decide(verdict(Status.CRITICAL), node("c3"), passes=5, resume_after=3, own_reason="")
    assert d.kind is drain.Kind.DRAIN and d.why == "xid 79 on GPU 5" and d.passes == 0


def test_critical_on_an_operators_drain_does_nothing() -> None:
    d = gate.decide(verdict(Status.CRITICAL), node("c4", ("IDLE", "DRAIN"), "maintenance"), 0, 3, "")
    assert d.kind is drain.Kind.NOTHING and "root" in d.why


def test_resume_only_after_n_passes_and_only_own_drains() -> None:
    ours = node("c3", ("IDLE", "DRAIN"), "gpuwarden: xid 79", changed=NOW - 100)
    ok = verdict(Status.OK, "fine")
    own = "gpuwarden: xid 79"
    assert gate.decide(ok, ours, passes=0, resume_after=3, own_reason=own).kind is drain.Kind.NOTHING
    assert gate.decide(ok, ours, passes=1, resume_after=3, own_reason=own).kind is drain.Kind.NOTHING
    d = gate.decide(ok, ours, passes=2, resume_after=3, own_reason=own)
    assert d.kind is drain.Kind.RESUME and d.passes == 3
    theirs = replace(ours, reason="maintenance")
    assert gate.decide(ok, theirs, passes=10, resume_after=3, own_reason=own).kind is drain.Kind.NOTHING


def test_a_gpuwarden_drain_made_elsewhere_is_not_resumed_by_health_checks() -> None:
    by_hand = node("c3", ("IDLE", "DRAIN"), "gpuwarden: RMA ticket 1234", changed=NOW - 100)
    d = gate.decide(verdict(Status.OK), by_hand, passes=9, resume_after=3,
                    own_reason="gpuwarden: xid 79")
    assert d.kind is drain.Kind.NOTHING


def test_a_reboot_after_the_drain_resumes_at_the_first_pass() -> None:
    ours = node("c3", ("IDLE", "DRAIN"), "gpuwarden: xid 79", changed=NOW - 1000, boot=int(NOW - 10))
    d = gate.decide(verdict(Status.OK), ours, passes=0, resume_after=3, own_reason="gpuwarden: xid 79")
    assert d.kind is drain.Kind.RESUME and "rebooted" in d.why


def test_unknown_neither_drains_nor_resumes_and_breaks_the_streak() -> None:
    ours = node("c3", ("IDLE", "DRAIN"), "gpuwarden: x")
    d = gate.decide(verdict(Status.UNKNOWN), ours, passes=2, resume_after=3, own_reason="gpuwarden: x")
    assert d.kind is drain.Kind.NOTHING and d.passes == 0


def fleet(n: int = 8, drained: tuple[str, ...] = (), claims: dict[str, float] | None = None) -> list[Node]:
    out = []
    for i in range(1, n + 1):
        name = f"c{i}"
        if name in drained:
            out.append(node(name, ("IDLE", "DRAIN"), "gpuwarden: bad", changed=NOW - 60))
        elif claims and name in claims:
            out.append(node(name, comment=f"gpuwarden: drain claim {claims[name]:.6f}"))
        else:
            out.append(node(name))
    return out


CAP = BlastRadius(max_drained_pct=25.0, settle_s=0)


def allows(me: str, nodes: list[Node], cap: BlastRadius = CAP, now: float = NOW) -> tuple[bool, str]:
    """cap_allows over a whole table, as the gate sees it: out-of-service nodes and sizes."""
    sizes: dict[str, int] = {}
    for n in nodes:
        for p in n.partitions:
            sizes[p] = sizes.get(p, 0) + 1
    mine = next(n for n in nodes if n.name == me)
    return drain.cap_allows(me, mine.partitions, [n for n in nodes if n.unavailable], sizes, cap,
                            now)


def test_cap_counts_gpuwarden_drains_in_the_partition() -> None:
    assert allows("c3", fleet(drained=("c1",)))[0]
    ok, why = allows("c3", fleet(drained=("c1", "c2")))
    assert not ok and "2 of 8 nodes in gpu" in why and "limit 2 (25%)" in why


def test_operator_drains_do_not_use_up_the_cap() -> None:
    nodes = fleet(drained=("c1",))
    nodes[1] = node("c2", ("IDLE", "DRAIN"), "maintenance")
    assert allows("c3", nodes)[0]


def test_without_a_window_old_drains_keep_counting_and_with_one_they_expire() -> None:
    nodes = [replace(n, reason_changed_at=int(NOW - 200_000)) if n.drained else n
             for n in fleet(drained=("c1", "c2"))]
    assert not allows("c3", nodes)[0]
    assert allows("c3", nodes, replace(CAP, window_s=86_400))[0]


def test_nodes_down_since_our_drain_still_count() -> None:
    nodes = [replace(n, state=("DOWN", "DRAIN")) if n.drained else n
             for n in fleet(drained=("c1", "c2"))]
    assert not allows("c3", nodes)[0]


def test_an_operators_comment_never_stops_a_drain() -> None:
    slurm = FakeSlurm({n.name: n for n in fleet()})
    slurm.table["c3"] = replace(slurm.table["c3"], comment="rack 7, ticket 42")
    d = drain.Decision(drain.Kind.DRAIN, "xid 79 on GPU 5", 0)
    applied = drain.apply(d, slurm.table["c3"], slurm, CAP, clock=lambda: NOW, sleep=lambda s: None)  # type: ignore[arg-type]
    assert applied.action == "drained" and slurm.log == ["drain c3"]
    assert slurm.table["c3"].comment == "rack 7, ticket 42"


def test_drains_rank_by_the_controllers_stamp_then_by_name() -> None:
    nodes = fleet(drained=("c1",))
    for name, stamp in (("c7", NOW - 2), ("c5", NOW - 1), ("c6", NOW - 1)):
        i = int(name[1:]) - 1
        nodes[i] = node(name, ("IDLE", "DRAIN"), "gpuwarden: bad", changed=stamp)
    nodes[0] = replace(nodes[0], reason_changed_at=int(NOW - 600))
    # c1 holds the first place, c7 (stamped first) the second; c5 and c6 come too late.
    assert allows("c7", nodes)[0]
    assert not allows("c5", nodes)[0]
    assert not allows("c6", nodes)[0]


def test_a_node_not_yet_drained_ranks_after_every_drain() -> None:
    assert not allows("c8", fleet(drained=("c1", "c2")))[0]
    assert allows("c8", fleet(drained=("c1",)))[0]


def test_absolute_cap_applies_across_partitions() -> None:
    nodes = fleet(n=100, drained=("c1", "c2", "c3"))
    assert not allows("c9", nodes, replace(CAP, max_drained_nodes=3))[0]
    assert allows("c9", nodes, replace(CAP, max_drained_nodes=4))[0]


def test_one_node_can_always_be_drained_in_a_small_partition() -> None:
    assert allows("c1", fleet(n=3), BlastRadius(max_drained_pct=10))[0]


def test_a_partition_of_unknown_size_gets_the_smallest_cap() -> None:
    drained = [node("c1", ("IDLE", "DRAIN"), "gpuwarden: bad", changed=NOW - 60)]
    assert not drain.cap_allows("c3", ("gpu",), drained, {}, CAP, NOW)[0]
    assert drain.cap_allows("c3", ("gpu",), [], {}, CAP, NOW)[0]


def test_apply_past_the_cap_reports_would_drain_in_the_node_comment() -> None:
    slurm = FakeSlurm({n.name: n for n in fleet(drained=("c1", "c2"))})
    d = drain.Decision(drain.Kind.DRAIN, "xid 79 on GPU 5", 0)
    applied = drain.apply(d, slurm.table["c3"], slurm, CAP, clock=lambda: NOW, sleep=lambda s: None)  # type: ignore[arg-type]
    assert applied.action == "held" and slurm.log == []
    assert slurm.table["c3"].comment.startswith("gpuwarden: would drain: xid 79 on GPU 5")


def test_apply_drains_and_clears_an_earlier_would_drain() -> None:
    slurm = FakeSlurm({n.name: n for n in fleet()})
    slurm.table["c3"] = replace(slurm.table["c3"], comment="gpuwarden: would drain: old (cap)")
    d = drain.Decision(drain.Kind.DRAIN, "xid 79 on GPU 5", 0)
    applied = drain.apply(d, slurm.table["c3"], slurm, CAP, clock=lambda: NOW, sleep=lambda s: None)  # type: ignore[arg-type]
    assert applied.action == "drained" and slurm.log == ["drain c3"]
    assert slurm.table["c3"].reason == "gpuwarden: xid 79 on GPU 5"
    assert slurm.table["c3"].comment == ""


@pytest.mark.parametrize("cap_pct", [25.0, 50.0])
def test_concurrent_drains_never_exceed_the_cap(cap_pct: float) -> None:
    """Five nodes drain in the same controller second, then each looks again: as many keep
    their drain as the cap allows, the same ones whoever looks first."""
    cap = replace(CAP, max_drained_pct=cap_pct)
    faulty = ["c1", "c2", "c5", "c6", "c7"]
    nodes = fleet(drained=tuple(faulty))
    kept = [n for n in faulty if allows(n, nodes, cap)[0]]
    assert kept == faulty[:int(8 * cap_pct / 100)]


def test_a_healthy_node_clears_only_its_own_stale_comments() -> None:
    assert drain.health_may_clear("gpuwarden: would drain: xid 79 on GPU 5 (cap)")
    assert drain.health_may_clear(f"gpuwarden: drain claim {NOW - 1:.6f}")  # older versions'
    assert not drain.health_may_clear("gpuwarden: would drain: lemon, 7 of 41 jobs failed")
    assert not drain.health_may_clear("waiting for RMA 1234")
