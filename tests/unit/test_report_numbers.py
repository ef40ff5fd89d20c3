"""The report's figures on a small history worked out by hand: 8 runs on 2026-01-01/02 in
partitions a and b, and four node events (test_report_page.py renders it too)."""

from __future__ import annotations

import math

import pytest

from gpuwarden.accounting.attribution import attribute, health_drains, node_failures
from gpuwarden.accounting.history import History
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report import stats
from gpuwarden.report.build import Options, Report, build
from gpuwarden.report.collect import RunTally
from gpuwarden.report.drains import owner
from gpuwarden.report.ettr import parts
from gpuwarden.slurm.models import AcctJob, NodeEvent

T0 = 1_767_225_600  # 2026-01-01T00:00:00Z
H = 3600
DAY = 86_400
LEAVES = {**{f"n{i}": "s1" for i in range(1, 5)}, **{f"n{i}": "s2" for i in range(5, 10)}}


def job(job_id: int, state: str, partition: str, nodes: str, gpus: int, start: int,
        hours: float, submit: int | None = None) -> AcctJob:
    count = 2 if "[" in nodes else 1
    return AcctJob(job_id, "train", "alice", state, "", partition, nodes, count, gpus,
                   1 if state == "FAILED" else 0, None, submit, start, start + int(hours * H),
                   0)


JOBS = [
    job(1, "COMPLETED", "a", "n1", 8, T0, 10),
    job(2, "NODE_FAIL", "a", "n[2-3]", 16, T0, 5, submit=T0 - 600),
    job(3, "FAILED", "b", "n4", 8, T0 + DAY, 2),
    job(4, "TIMEOUT", "b", "n5", 8, T0 + DAY, 4),
    job(5, "CANCELLED", "a", "n1", 8, T0 + DAY, 1),
    job(6, "FAILED", "b", "n[4-5]", 16, T0 + DAY, 3, submit=T0 + DAY - 1800),
    job(7, "PREEMPTED", "a", "n8", 8, T0 + DAY, 1),
    job(8, "OUT_OF_MEMORY", "a", "n9", 8, T0 + DAY, 2),
]


def event(node: str, start: str, end: str, state: str, reason: str) -> NodeEvent:
    return NodeEvent("c", node, start, end, state, reason, "root(0)")


EVENTS = [
    event("n4", "2026-01-01T02:00:00", "2026-01-01T06:00:00", "DRAIN",
          "gpuwarden: xid 79 on GPU 3 [health]"),
    event("n5", "2026-01-02T00:00:00", "Unknown", "DRAIN", "gpuwarden: lemon, 4 of 9 failed"),
    event("n8", "2026-01-01T20:00:00", "2026-01-02T02:00:00", "DRAIN", "maintenance: bios"),
    event("n2", "2026-01-01T04:58:00", "2026-01-01T05:10:00", "DOWN*", "Not responding"),
    event("", "2026-01-01T00:00:00", "Unknown", "", "Cluster Registered TRES"),
]


def history(leaves: dict[str, str] | None = None) -> History:
    tally = RunTally(leaves)
    tally.add(JOBS)
    att = attribute(JOBS, health_drains(EVENTS), failures=node_failures(EVENTS))
    return History(att, len(JOBS), tuple(EVENTS), tally)


OPTS = Options("test", ckpt_cost_s=36, interval_h=1.0, restart_h=0.5, spares=1, swap_h=0.05,
               have_topology=True)


@pytest.fixture(scope="module")
def rep() -> Report:
    return build(history(LEAVES), OPTS, ScoreConfig())


def test_poisson_interval_matches_the_chi_square_tables() -> None:
    # Garwood: [chi2(0.025; 2k)/2, chi2(0.975; 2k+2)/2]; from the tables: k=0: [0, 7.378/2];
    # k=2: [0.4844/2, 14.449/2]; k=10: [9.591/2, 36.781/2].
    assert stats.poisson_interval(0) == (0.0, pytest.approx(3.6889, abs=1e-4))
    assert stats.poisson_interval(2) == (pytest.approx(0.2422, abs=1e-4),
                                         pytest.approx(7.2247, abs=1e-4))
    assert stats.poisson_interval(10) == (pytest.approx(4.7954, abs=1e-4),
                                          pytest.approx(18.390, abs=1e-3))
    # Above the exact range, Wilson-Hilferty: k=1000 -> [938.97, 1063.95] (tables: 938.97,
    # 1063.95 to two decimals).
    lo, hi = stats.poisson_interval(1000)
    assert lo == pytest.approx(938.97, abs=0.02) and hi == pytest.approx(1063.95, abs=0.02)


def test_mttf_by_size_with_its_interval(rep: Report) -> None:
    eight, sixteen = rep.mttf.classes
    # 8 GPUs: runs 1,3,4,5,7,8 = 10+2+4+1+1+2 = 20 job-hours, no infrastructure failure (3 is
    # the user's FAILED on a node nobody drained, 8 ran out of memory): no MTTF, and 95% sure
    # it is at least 20 / 3.6889 = 5.42 h.
    assert (eight.runs, eight.job_hours, eight.failures, eight.mttf_h) == (6, 20.0, 0, None)
    assert (eight.mttf_low_h, eight.mttf_high_h) == (5.42, None)
    assert eight.paper_mttf_h == 1144.8  # Meta: 47.7 days x 24
    # 16 GPUs: runs 2 (NODE_FAIL, 5 h) and 6 (a 2-node FAILED, 3 h): 8 h / 2 = 4 h; interval
    # 8 / 7.2247 = 1.11 h to 8 / 0.2422 = 33.03 h, shown to 3 significant figures.
    assert (sixteen.runs, sixteen.job_hours, sixteen.failures, sixteen.mttf_h) == (2, 8.0, 2, 4.0)
    assert (sixteen.mttf_low_h, sixteen.mttf_high_h) == (1.11, 33.0)
    # Too few failures to project (fleet.mttf.MIN_FAILURES = 10); Meta's figures still shown.
    assert [(p.gpus, p.from_history_h, p.paper_h) for p in rep.mttf.projections] == [
        (16_384, None, 1.8), (131_072, None, 0.23)]
    assert rep.mttf.insufficient.startswith(
        "insufficient data: 2 job failure(s) blamed on the infrastructure")


def test_failures_by_class_and_partition_per_day(rep: Report) -> None:
    o = rep.outcomes
    assert o.bins == ["2026-01-01", "2026-01-02"] and o.unmatched_blames == 0
    a, b = o.partitions
    # a: 1 completed, 2 NODE_FAIL (hardware, day 1), 5 cancelled, 7 preempted, 8 OOM (user).
    assert (a.partition, a.runs) == ("a", 5)
    assert a.counts == {"hardware": [1, 0], "user": [0, 1], "timeout": [0, 0],
                        "cancelled": [0, 1], "preempted": [0, 1]}
    # b: 3 FAILED alone (user), 4 TIMEOUT, 6 FAILED on two nodes (hardware, rule 3), day 2.
    assert (b.partition, b.runs) == ("b", 3)
    assert b.counts == {"hardware": [0, 1], "user": [0, 1], "timeout": [0, 1],
                        "cancelled": [0, 0], "preempted": [0, 0]}
    # The hardware class is exactly the MTTF section's failures.
    assert o.totals["hardware"] == rep.mttf.failures == 2


def test_ettr_per_size_as_formulated(rep: Report) -> None:
    eight, sixteen = rep.ettr.rows
    # tau = 1 h, C = 36 s = 0.01 h, u0 = 0.5 h.
    # 8 GPUs: H = 20, F = 0: (20 - 0 - 20 * 0.01 / 1) / 20 = 0.99; no Daly interval.
    assert (eight.ettr_now, eight.daly_h, eight.ettr_daly) == (0.99, None, None)
    # 16 GPUs: H = 8, F = 2: (8 - 2 * 0.5 - 8 * 0.01) / (8 + 2 * 0.5) = 6.92 / 9 = 0.7689.
    assert sixteen.ettr_now == 0.7689
    # Daly at C = 0.01, M = 4: x = C/2M = 0.00125; sqrt(0.08) * (1 + sqrt(x)/3 + x/9) - C
    # = 0.282843 * 1.011924 - 0.01 = 0.276215 h.
    tau = math.sqrt(0.08) * (1 + math.sqrt(0.00125) / 3 + 0.00125 / 9) - 0.01
    assert sixteen.daly_h == 0.276 and tau == pytest.approx(0.276215, abs=1e-6)
    # (8 - 2 * tau / 2 - 8 * 0.01 / tau) / 9 = (8 - 0.276215 - 0.289629) / 9 = 0.8260.
    assert sixteen.ettr_daly == 0.826
    # One spare of n = 2 nodes, swap 0.05 h: 7.434156 / (8 + 2 * 0.05) * 2 / 3 = 0.6119.
    assert sixteen.ettr_spares == 0.6119
    # 8 GPUs fit one node: no spare (half a job's nodes idle is no redundancy): 0.99 as today.
    assert eight.ettr_spares == 0.99
    # What the spare holds idle, H x k x GPUs per node = 8 x 1 x 8 = 64 GPU-hours, against what
    # requeues lose that a spare would not, F x (u0 - s) x 16 GPUs = 2 x 0.45 x 16 = 14.4: no.
    assert (sixteen.spare_idle_gpu_h, sixteen.requeue_lost_gpu_h) == (64.0, 14.4)
    assert sixteen.spares_pay is False and eight.spares_pay is None
    # Fleet today, weighted by GPU-hours (8 GPUs x 20 h, 16 GPUs x 8 h):
    # (19.8 * 8 + 6.92 * 16) / (20 * 8 + 9 * 16) = 269.12 / 304 = 0.8853.
    assert rep.ettr.fleet_now == 0.8853
    assert parts(8, 2, 1.0, 0.01, 0.5) == (pytest.approx(6.92), 9.0)


def _figures(rep: Report, key: str) -> dict[str, object]:
    t = next(t for t in rep.tradeoffs if t.key == key)
    return {f.label: f.value for f in t.figures}


def test_tradeoffs_from_the_history(rep: Report) -> None:
    store = _figures(rep, "filesystem_vs_object_store")
    # Runs 2 and 6 restore, 16 GPUs each: 32 GPUs; a minute of restore = 32 / 60 GPU-hours.
    assert store["GPUs held by those runs, summed"] == 32
    assert store["cost of each minute of restore time"] == 0.53
    assert store["restore time from the object store (median)"] is None  # no --ckpt-root
    health = _figures(rep, "proactive_vs_reactive")
    # One health drain (n4, day 1, 02:00): no run on n4 failed near it, so found first.
    assert health["health-gating drains (the MTTF section's node failures)"] == 1
    assert health["drains with no failed run behind them (found before a job failed)"] == 1
    # Its reason names no check (written before reasons carried one).
    assert health["prolog drains (each kept a starting job off a bad node)"] == 0
    assert health["drains whose reason names no check (before gpuwarden named it)"] == 1
    place = _figures(rep, "central_vs_negotiated")
    # Run 2 on n[2-3] (leaf s1, waited 600 s), run 6 on n[4-5] (s1 and s2, waited 1800 s).
    assert place["gang runs within one leaf switch"] == 1
    assert place["share within one leaf switch"] == 50.0
    assert place["mean queue wait, within one leaf"] == 10.0
    assert place["mean queue wait, across leaves"] == 30.0


def test_placement_says_it_needs_the_topology() -> None:
    rep = build(history(), Options("test"), ScoreConfig())
    t = next(t for t in rep.tradeoffs if t.key == "central_vs_negotiated")
    assert t.figures[0].value is None and "--topology" in t.missing[0]


def test_drains_by_owner_per_day(rep: Report) -> None:
    d = rep.drains
    # Window: the first start (day 1 00:00) to the last end (day 2 04:00).
    assert d.days == ["2026-01-01", "2026-01-02"]
    # health: n4 02:00-06:00 = 4 h; slurm: n2 04:58-05:10 = 0.2 h; operator: n8 20:00 to
    # 02:00 next day = 4 h + 2 h; lemon: n5 from day 2 00:00, still open: to 04:00 = 4 h.
    assert d.node_hours == {"health": [4.0, 0.0], "lemon": [0.0, 4.0],
                            "operator": [4.0, 2.0], "slurm": [0.2, 0.0]}
    assert d.events == {"health": 1, "lemon": 1, "operator": 1, "slurm": 1}
    assert d.open_events == 1
    assert [owner(r) for r in ("gpuwarden: lemon x", "gpuwarden: ecc [health]",
                               "Kill task failed", "rack move")] == [
        "lemon", "health", "slurm", "operator"]


def test_no_lemon_in_so_little_history(rep: Report) -> None:
    assert rep.lemons == []
    assert not rep.gating.available and "live cluster" in rep.gating.note
