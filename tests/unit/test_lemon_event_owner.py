"""One node failure event is the culprit of at most one failed run: the run whose end is
nearest it within the grace window (ties: the one ending at or before it)."""

from __future__ import annotations

from gpuwarden.accounting.attribution import Attribution, HealthDrain, attribute
from gpuwarden.slurm.models import AcctJob

T0 = 1_800_000_000
EVENT = HealthDrain("c3", T0 + 3600, "gpuwarden: xid 79 on GPU 5")


def run(jid: int, state: str, nodes: str, start: int, end: int, exit_code: int = 1) -> AcctJob:
    return AcctJob(jid, "j", "alice", state, "", "gpu", nodes, 0, 8, exit_code, None,
                   start - 10, start, end, 0)


def pinned_on(att: Attribution, node: str) -> list[int | None]:
    """The runs whose failure the events pin on ``node`` (it alone takes the blame)."""
    return sorted(b.job_id for b in att.blames if b.node == node and b.weight == 1.0)


def test_one_event_between_two_runs_is_the_culprit_of_the_nearest_one_only() -> None:
    before = run(1, "NODE_FAIL", "c[1-4]", T0, T0 + 3600 - 60)  # ends 1 min before the event
    after = run(2, "NODE_FAIL", "c[3-6]", T0 + 3600 + 30, T0 + 3600 + 200)  # 200 s after
    att = attribute([before, after], [EVENT])
    assert pinned_on(att, "c3") == [1]
    # The other run is spread over its nodes: the event is not evidence for it too.
    assert sorted((b.node, b.weight) for b in att.blames if b.job_id == 2) == [
        (f"c{i}", 0.25) for i in range(3, 7)]


def test_which_run_owns_the_event_does_not_depend_on_the_order_runs_are_read() -> None:
    a = run(1, "NODE_FAIL", "c[1-4]", T0, T0 + 3600 + 10)
    b = run(2, "NODE_FAIL", "c[3-6]", T0 + 600, T0 + 3600 - 1000)
    for jobs in ([a, b], [b, a]):
        assert pinned_on(attribute(jobs, [EVENT]), "c3") == [1]


def test_a_tie_goes_to_the_run_that_ended_at_or_before_the_event() -> None:
    early = run(1, "NODE_FAIL", "c[1-3]", T0, T0 + 3600 - 100)
    late = run(2, "NODE_FAIL", "c[3-5]", T0, T0 + 3600 + 100)
    assert pinned_on(attribute([late, early], [EVENT]), "c3") == [1]


def test_a_requeue_explained_only_by_another_runs_event_is_not_blamed() -> None:
    failed = run(1, "NODE_FAIL", "c[2-3]", T0, T0 + 3600)
    requeued = run(2, "REQUEUED", "c[3-4]", T0, T0 + 3600 - 250)
    att = attribute([failed, requeued], [EVENT])
    assert {b.job_id for b in att.blames} == {1}


def test_a_drain_blames_one_single_node_failure_not_also_the_next() -> None:
    drain = HealthDrain("c1", T0 + 3600 + 20, "gpuwarden: xid 79 on GPU 5")
    first = run(1, "FAILED", "c1", T0, T0 + 3600 + 10)  # the drain ended it
    retry = run(2, "FAILED", "c1", T0 + 3600 + 15, T0 + 3600 + 300)  # started before the drain
    att = attribute([retry, first], [drain])
    assert [b.job_id for b in att.blames] == [1]
    assert len(att.incidence.hours) == 1


def test_runs_read_in_separate_batches_still_share_one_event() -> None:
    before = run(1, "NODE_FAIL", "c[1-4]", T0, T0 + 3600 - 60)
    after = run(2, "NODE_FAIL", "c[3-6]", T0 + 3600 + 30, T0 + 3600 + 200)
    from gpuwarden.accounting.attribution import add_lone_drains, attribute_runs, by_node

    drains = by_node([EVENT])
    parts = [attribute_runs([j], drains) for j in (after, before)]
    att = add_lone_drains(parts[0].merge(parts[1]), drains)
    assert pinned_on(att, "c3") == [1]


def test_a_single_node_failure_that_lost_its_drain_is_not_blamed_on_a_down() -> None:
    """Rule 4 needs a health drain: a Slurm DOWN the run is nearest to does not stand in."""
    from datetime import UTC, datetime

    from gpuwarden.accounting.attribution import node_failures
    from gpuwarden.slurm.models import NodeEvent

    drain = HealthDrain("c1", T0 + 3600, "gpuwarden: xid 79 on GPU 5")
    when = datetime.fromtimestamp(T0 + 3800, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    downs = node_failures([NodeEvent("g", "c1", when, "Unknown", "DOWN", "Not responding", "r")])
    owner = run(1, "NODE_FAIL", "c[1-2]", T0, T0 + 3600)  # ends at the drain: owns it
    single = run(2, "FAILED", "c1", T0, T0 + 3650)  # nearer the down than the owner is
    att = attribute([owner, single], [drain], failures=[drain, *downs])
    assert {b.job_id for b in att.blames} == {1}
