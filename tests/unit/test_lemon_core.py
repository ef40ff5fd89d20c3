"""Attribution rules (each one) and scoring, on hand-made accounting records."""

from __future__ import annotations

import random

import pytest

from gpuwarden.lemon.attribution import HealthDrain, attribute, health_drains
from gpuwarden.lemon.scoring import ScoreConfig, benjamini_hochberg, poisson_sf, score
from gpuwarden.slurm.models import AcctJob, NodeEvent

T0 = 1_800_000_000


def job(jid: int, state: str, nodes: str, start: int = T0, hours: float = 1.0,
        exit_code: int | None = 0) -> AcctJob:
    n = len(nodes.split(",")) if "[" not in nodes else 0
    return AcctJob(jid, "j", "alice", state, "", "gpu", nodes, n, 8, exit_code, None,
                   start - 10, start, start + int(hours * 3600), 0)


def blamed(jobs: list[AcctJob], drains: list[HealthDrain] | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in attribute(jobs, drains or []).blames:
        out[b.node] = out.get(b.node, 0) + b.weight
    return out


def test_rule1_node_fail_blames_its_nodes_spread() -> None:
    assert blamed([job(1, "NODE_FAIL", "c1")]) == {"c1": 1.0}
    assert blamed([job(1, "BOOT_FAIL", "c[1-4]")]) == {f"c{i}": 0.25 for i in range(1, 5)}


def test_rule2_requeued_run_blames_its_node() -> None:
    assert blamed([job(1, "REQUEUED", "c3")]) == {"c3": 1.0}


def test_rule3_failed_gang_job_spreads_blame() -> None:
    assert blamed([job(1, "FAILED", "c[1-2]", exit_code=1)]) == {"c1": 0.5, "c2": 0.5}


def test_rule4_single_node_failure_is_the_users_on_a_healthy_node() -> None:
    assert blamed([job(1, "FAILED", "c1", exit_code=1)]) == {}


def test_rule4_single_node_failure_counts_when_health_gating_drained_the_node() -> None:
    drain = HealthDrain("c1", T0 + 3600 + 60, "gpuwarden: xid 79 on GPU 5")
    assert blamed([job(1, "FAILED", "c1", exit_code=1)], [drain]) == {"c1": 1.0}


def test_rule5_a_drain_counts_once_not_twice() -> None:
    drain = HealthDrain("c1", T0 + 3600 + 60, "gpuwarden: xid 79 on GPU 5")
    lone = HealthDrain("c2", T0, "gpuwarden: ecc")
    result = blamed([job(1, "REQUEUED", "c1")], [drain, lone])
    assert result == {"c1": 1.0, "c2": 1.0}


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY",
                                   "PREEMPTED", "DEADLINE"])
def test_rule6_user_and_scheduler_outcomes_never_blame(state: str) -> None:
    assert blamed([job(1, state, "c[1-8]")]) == {}


def test_exposure_counts_every_run_and_its_hours() -> None:
    att = attribute([job(1, "COMPLETED", "c[1-2]", hours=2), job(2, "FAILED", "c1", hours=1)])
    assert att.exposure["c1"].jobs == 2 and att.exposure["c1"].hours == pytest.approx(3.0)
    assert att.exposure["c2"].jobs == 1


def test_malformed_records_are_skipped_and_counted() -> None:
    bad_nodes = job(1, "NODE_FAIL", "c[1-")
    no_end = AcctJob(2, "j", "a", "FAILED", "", "gpu", "c1", 1, 0, 1, None, T0, T0, None, 0)
    att = attribute([bad_nodes, no_end, job(3, "NODE_FAIL", "c2")])
    assert att.skipped == {"unreadable node list": 1, "no start or end time": 1}
    assert [b.node for b in att.blames] == ["c2"]


def test_health_drains_from_events_skip_lemon_and_operator_drains() -> None:
    events = [
        NodeEvent("g", "c1", "2026-11-29T10:00:00", "Unknown", "DRAIN", "gpuwarden: xid 79", "root"),
        NodeEvent("g", "c2", "2026-11-29T10:00:00", "Unknown", "DRAIN", "maintenance", "root"),
        NodeEvent("g", "c3", "2026-11-29T10:00:00", "Unknown", "DRAIN",
                  "gpuwarden: lemon, 7 of 41 jobs failed", "root"),
        NodeEvent("g", "", "2026-11-29T10:00:00", "Unknown", "", "Cluster Registered TRES", ""),
    ]
    assert [d.node for d in health_drains(events)] == ["c1"]


def test_poisson_tail_matches_known_values() -> None:
    assert poisson_sf(0, 3.0) == 1.0
    assert poisson_sf(1, 2.0) == pytest.approx(1 - 0.1353352832, rel=1e-9)
    assert poisson_sf(10, 1.0) == pytest.approx(1.1142547e-07, rel=1e-6)
    assert 0 < poisson_sf(500, 50.0) < 1e-150


def test_benjamini_hochberg() -> None:
    # sorted 0.01, 0.03, 0.04, 0.5 -> 0.04, 0.06, 0.0533, 0.5, then made monotone from the top
    assert benjamini_hochberg([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.5])


def fleet_history(lemons: set[str], seed: int, nodes: int = 64, jobs: int = 4000) -> list[AcctJob]:
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(nodes)]
    out = []
    for jid in range(jobs):
        node = rng.choice(names)
        p_fail = 0.15 if node in lemons else 0.01
        state = "NODE_FAIL" if rng.random() < p_fail else "COMPLETED"
        out.append(job(jid, state, node, start=T0 + jid * 60))
    return out


def test_scoring_finds_the_lemons_and_only_them() -> None:
    lemons = {"n7", "n42"}
    scores = score(attribute(fleet_history(lemons, seed=1)))
    assert {s.node for s in scores if s.lemon} == lemons
    top = scores[0]
    assert top.lemon and top.summary.startswith(f"lemon, {top.failures} of {top.jobs} jobs failed")
    assert len(top.evidence) == top.failures


def test_a_clean_history_flags_nothing() -> None:
    assert not [s for s in score(attribute(fleet_history(set(), seed=2))) if s.lemon]


def test_too_little_evidence_is_no_verdict() -> None:
    jobs = [job(1, "NODE_FAIL", "c1"), job(2, "NODE_FAIL", "c1"), job(3, "COMPLETED", "c2")]
    assert not [s for s in score(attribute(jobs), ScoreConfig(min_jobs=10)) if s.lemon]


def test_attribution_on_accounting_captured_from_the_real_cluster(fixture_text) -> None:  # type: ignore[no-untyped-def]
    from gpuwarden.slurm import parse

    recs = [r for r in parse.iter_acct_jobs(fixture_text("sacct.json")) if isinstance(r, AcctJob)]
    att = attribute(recs)
    assert [(b.node, b.job_id, b.reason) for b in att.blames] == [
        ("c8", 7, "node failure (NODE_FAIL)")]
    assert att.exposure["c3"].jobs >= 2  # the failed (user's) and the timed-out job ran there


def sacct_export(jobs: list[AcctJob]) -> str:
    import json

    return json.dumps({"jobs": [{
        "job_id": j.job_id, "name": j.name, "user": j.user, "nodes": j.nodes,
        "state": {"current": [j.state], "reason": "None"},
        "allocation_nodes": 1, "partition": "gpu",
        "time": {"submission": j.submit_time, "start": j.start_time, "end": j.end_time},
        "exit_code": {"status": ["SUCCESS"], "return_code": {"set": True, "infinite": False,
                                                               "number": 0}},
    } for j in jobs] + [{"name": "no id"}]})


def test_lemon_scan_from_an_export_ranks_the_lemon_with_its_evidence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from click.testing import CliRunner

    from gpuwarden.cli import Context, cli

    export = tmp_path / "sacct.json"
    export.write_text(sacct_export(fleet_history({"n7"}, seed=3)))
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export), "--json"],
                             obj=Context())
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["records"] == 4000 and doc["skipped"] == {f"{export}: malformed record": 1}
    lemons = [n for n in doc["nodes"] if n["lemon"]]
    assert [n["node"] for n in lemons] == ["n7"]
    assert lemons[0]["failures"] == len(lemons[0]["evidence"]) >= 3
    text = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export)], obj=Context()).stdout
    assert "n7" in text and "lemon," in text and "node failure (NODE_FAIL)" in text


def test_lemon_scan_rejects_a_file_that_is_not_sacct_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from gpuwarden.cli import Context, cli

    bad = tmp_path / "x.json"
    bad.write_text("hello")
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(bad)], obj=Context())
    assert res.exit_code == 1 and "expected `sacct --json` output" in res.output
