"""The blast-radius cap against real sites: operators' comments, skewed clocks, big clusters, and
other writers landing between gpuwarden's calls. The real CliSlurmClient talks to a stand-in
slurmctld (tests/ctld.py) that answers in the captured JSON shapes and stamps reasons with its
own clock."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from gpuwarden.slurm import drain
from gpuwarden.slurm.client import CliSlurmClient
from gpuwarden.slurm.drain_cap import BlastRadius
from gpuwarden.slurm.settings import SlurmConfig
from tests.ctld import FakeCtld

NOW = 1_800_000_000.0
CAP = BlastRadius(max_drained_pct=25.0, settle_s=0)
DRAIN = drain.Decision(drain.Kind.DRAIN, "xid 79 on GPU 5", 0)
LEMON = "gpuwarden: lemon, 7 of 41 jobs failed, fleet rate 0.9%"


def client(ctld: FakeCtld) -> CliSlurmClient:
    return CliSlurmClient(SlurmConfig(retries=0), ctld)


def health_drain(ctld: FakeCtld, name: str, cap: BlastRadius = CAP,
                 clock: Callable[[], float] = lambda: NOW,
                 sleep: Callable[[float], None] = lambda s: None) -> drain.Applied:
    c = client(ctld)
    return drain.apply(DRAIN, c.node(name), c, cap, clock, sleep)


def once(match: Callable[[tuple[str, ...]], bool], act: Callable[[], None]
         ) -> Callable[[tuple[str, ...]], None]:
    """A `before` hook that lands someone else's change just before the first matching call."""
    fired: list[bool] = []

    def hook(argv: tuple[str, ...]) -> None:
        if not fired and match(argv):
            fired.append(True)
            act()

    return hook


def test_a_node_whose_comment_holds_operator_text_is_drained_and_keeps_the_comment() -> None:
    ctld = FakeCtld.cluster(8)
    ctld.set("c3", comment="rack B07 u12")
    applied = health_drain(ctld, "c3")
    assert applied.action == "drained"
    assert ctld.table["c3"].reason == "gpuwarden: xid 79 on GPU 5"
    assert ctld.table["c3"].comment == "rack B07 u12"
    assert not [c for c in ctld.calls if any(a.startswith("comment=") for a in c)]


def test_skewed_node_clocks_never_let_two_drains_past_a_cap_of_one() -> None:
    """c2 and c3 go bad at once, their clocks 61 s apart; 25% of 4 nodes is one place. Both
    decide, both reach their drain, both wait, both look again: exactly one stays drained."""
    ctld = FakeCtld.cluster(4, now=NOW)
    at_drain = threading.Barrier(2, timeout=10)
    at_settle = threading.Barrier(2, timeout=10)
    ctld.before = lambda argv: at_drain.wait() if "state=drain" in argv else None
    results: dict[str, drain.Applied | BaseException] = {}

    def run(name: str, skew: float) -> None:
        try:
            results[name] = health_drain(ctld, name, clock=lambda: NOW + skew,
                                         sleep=lambda s: at_settle.wait())
        except BaseException as exc:
            results[name] = exc

    threads = [threading.Thread(target=run, args=a) for a in (("c2", 0.0), ("c3", 61.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert ctld.drained == ["c2"], results
    held = results["c3"]
    assert isinstance(held, drain.Applied) and held.action == "held", results
    assert "blast-radius cap: 1 of 4 nodes in gpu" in held.detail
    assert ctld.table["c3"].comment.startswith("gpuwarden: would drain: xid 79 on GPU 5")


def test_the_earlier_controller_stamp_wins_whatever_the_names() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    ctld.set("c4", state=("IDLE", "DRAIN"), reason="gpuwarden: ecc", reason_changed_at=int(NOW))
    ctld.set("c1", state=("IDLE", "DRAIN"), reason="gpuwarden: ecc", reason_changed_at=int(NOW) + 1)
    view = client(ctld).out_of_service()
    sizes = {"gpu": 4}
    assert drain.cap_allows("c4", ("gpu",), view.nodes, sizes, CAP, NOW + 2)[0]
    assert not drain.cap_allows("c1", ("gpu",), view.nodes, sizes, CAP, NOW + 2)[0]


@pytest.mark.parametrize("nodes", [16, 1000, 4000])
def test_slurm_calls_and_bytes_per_drain_do_not_grow_with_the_cluster(nodes: int) -> None:
    base = FakeCtld.cluster(16)
    health_drain(base, "c3")
    ctld = FakeCtld.cluster(nodes)
    assert health_drain(ctld, "c3").action == "drained"
    assert ctld.bytes_out <= base.bytes_out * 1.05, (ctld.bytes_out, base.bytes_out)
    assert not [c for c in ctld.calls if c[1:3] == ("show", "nodes")]  # never the whole cluster
    assert len(ctld.calls) == len(base.calls) <= 8


def test_resume_rechecks_at_the_update_that_the_drain_is_still_its_own() -> None:
    ctld = FakeCtld.cluster(8)
    ctld.set("c3", state=("IDLE", "DRAIN"), reason="gpuwarden: xid 79 on GPU 5")
    c = client(ctld)
    seen = c.node("c3")
    decision = drain.Decision(drain.Kind.RESUME, "3 passing checks in a row", 3)
    # The lemon scanner drains c3 for its own reason after health gating read it.
    ctld.before = once(lambda a: True, lambda: ctld.set("c3", reason=LEMON))
    applied = drain.apply(decision, seen, c, CAP, lambda: NOW, lambda s: None)
    assert applied.action == "none" and "lemon" in applied.detail
    assert ctld.table["c3"].drained and ctld.table["c3"].reason == LEMON


@pytest.mark.parametrize("lands", ["at the first read", "just before the drain's own read"])
def test_a_health_drain_never_takes_over_a_lemon_drain_made_meanwhile(lands: str) -> None:
    ctld = FakeCtld.cluster(8)
    c = client(ctld)
    seen = c.node("c3")  # in service when health gating decided
    first = (lambda a: True) if lands == "at the first read" else (
        lambda a: a[1:4] == ("--all", "-n", "c3"))
    ctld.before = once(first, lambda: ctld.set("c3", state=("IDLE", "DRAIN"), reason=LEMON))
    applied = drain.apply(DRAIN, seen, c, CAP, lambda: NOW, lambda s: None)
    assert applied.action != "drained"
    assert ctld.table["c3"].reason == LEMON  # health gating will never resume it as its own


def test_an_operator_drain_made_while_deciding_is_left_alone_and_reported() -> None:
    ctld = FakeCtld.cluster(8)
    c = client(ctld)
    seen = c.node("c3")
    ctld.before = once(lambda a: True, lambda: ctld.operator_drain("c3", "maintenance"))
    applied = drain.apply(DRAIN, seen, c, CAP, lambda: NOW, lambda s: None)
    assert applied.action == "none" and "maintenance" in applied.detail
    assert ctld.table["c3"].reason == "maintenance" and ctld.table["c3"].comment == ""


def test_an_operator_drain_over_ours_while_settling_is_never_undone() -> None:
    """Past the cap our drain is undone, but only while its reason is still ours."""
    ctld = FakeCtld.cluster(4)
    c = client(ctld)
    # c1's drain lands with ours (the cap's one place is c1's); then an operator drains c3.
    ctld.before = once(lambda a: "state=drain" in a,
                       lambda: ctld.set("c1", state=("IDLE", "DRAIN"), reason="gpuwarden: ecc"))
    applied = drain.apply(DRAIN, c.node("c3"), c, CAP, lambda: NOW,
                          lambda s: ctld.operator_drain("c3", "maintenance"))
    assert applied.action == "none" and "maintenance" in applied.detail
    assert ctld.table["c3"].drained and ctld.table["c3"].reason == "maintenance"
    assert not [a for a in ctld.calls if "state=resume" in a]


def test_past_the_cap_a_drain_made_at_the_same_time_is_undone_and_says_would_drain() -> None:
    ctld = FakeCtld.cluster(4)
    # c1's drain lands in the same controller second, between our pre-check and our drain.
    ctld.before = once(lambda a: "state=drain" in a,
                       lambda: ctld.set("c1", state=("IDLE", "DRAIN"), reason="gpuwarden: ecc"))
    applied = health_drain(ctld, "c3")
    assert applied.action == "held" and "drained for a moment and undone" in applied.detail
    assert ctld.drained == ["c1"]
    assert ctld.table["c3"].comment.startswith("gpuwarden: would drain: xid 79 on GPU 5")
