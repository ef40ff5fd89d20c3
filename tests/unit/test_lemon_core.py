"""Attribution rules (each one) and scoring, on hand-made accounting records."""

from __future__ import annotations

import random

import pytest

from gpuwarden.accounting.attribution import HealthDrain, attribute, health_drains
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


def test_rule2_requeued_run_blames_the_node_that_failed_and_not_an_operators_requeue() -> None:
    drain = HealthDrain("c3", T0 + 3600 + 5, "gpuwarden: xid 79 on GPU 5")
    assert blamed([job(1, "REQUEUED", "c[3-4]")], [drain]) == {"c3": 1.0}
    assert blamed([job(1, "REQUEUED", "c3")]) == {}  # `scontrol requeue` or RequeueExit


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
        NodeEvent("g", "c1", "2026-11-29T10:00:00", "Unknown", "DRAIN", "gpuwarden: xid 79 [health]", "root"),
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
        ("c8", 7, "node failure (NODE_FAIL); Slurm recorded c8 as the node that failed")]
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

    from gpuwarden.cli import cli
    from gpuwarden.config.context import Context

    export = tmp_path / "sacct.json"
    export.write_text(sacct_export(fleet_history({"n7"}, seed=3)))
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export), "--json"],
                             obj=Context())
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["records"] == 4001 and doc["skipped"] == {f"{export}: malformed record": 1}
    lemons = [n for n in doc["nodes"] if n["lemon"]]
    assert [n["node"] for n in lemons] == ["n7"]
    assert lemons[0]["failures"] == len(lemons[0]["evidence"]) >= 3
    text = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export)], obj=Context()).stdout
    assert "n7" in text and "lemon," in text and "node failure (NODE_FAIL)" in text


def test_lemon_scan_rejects_a_file_that_is_not_sacct_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config.context import Context

    bad = tmp_path / "x.json"
    bad.write_text("hello")
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(bad)], obj=Context())
    assert res.exit_code == 1 and "expected `sacct --json` output" in res.output


def ev(node: str, at: float, state: str = "DOWN*", reason: str = "Not responding",
       end: float | None = None) -> NodeEvent:
    from datetime import UTC, datetime

    def fmt(t: float | None) -> str:
        return "Unknown" if t is None else datetime.fromtimestamp(t, UTC).strftime(
            "%Y-%m-%dT%H:%M:%S")
    return NodeEvent("g", node, fmt(at), fmt(end), state, reason, "root")


def test_a_gang_failure_is_pinned_on_the_node_that_went_down() -> None:
    from gpuwarden.accounting.attribution import node_failures

    run = job(1, "NODE_FAIL", "c[1-4]")
    down = ev("c3", T0 + 3600 - 20)  # slurmctld marked c3 down just before the run ended
    att = attribute([run], failures=node_failures([down]))
    assert [(b.node, b.weight) for b in att.blames] == [("c3", 1.0)]
    assert "c3 failed at the time" in att.blames[0].reason
    # An event long before the run ended says nothing about this run: blame is spread.
    old = ev("c3", T0 - 7200)
    assert blamed([run], None) == {f"c{i}": 0.25 for i in range(1, 5)}
    assert len(attribute([run], failures=node_failures([old])).blames) == 4


def test_operator_downs_drains_and_lemon_drains_are_not_node_failures() -> None:
    from gpuwarden.accounting.attribution import node_failures

    events = [ev("c1", T0, "DRAIN", "maintenance"), ev("c2", T0, "DRAIN", "gpuwarden: lemon, x"),
              ev("c3", T0, "DRAIN", "gpuwarden: xid 79 [health]"), ev("c4", T0),
              ev("c5", T0, "DOWN", "maint: swap PSU"), ev("c6", T0, "DOWN", "Kill task failed")]
    assert sorted(d.node for d in node_failures(events)) == ["c3", "c4", "c6"]


def test_a_drain_during_a_long_failed_run_counts_once() -> None:
    drain = HealthDrain("c1", T0 + 3600, "gpuwarden: xid 79 on GPU 5")  # 1 h into a 10 h run
    att = attribute([job(1, "FAILED", "c1", hours=10, exit_code=1)], [drain])
    assert [(b.node, b.job_id) for b in att.blames] == [("c1", 1)]


def test_a_drain_from_before_the_history_is_not_a_failure_in_it() -> None:
    old = HealthDrain("c2", T0 - 30 * 86_400, "gpuwarden: xid 79 on GPU 5")
    att = attribute([job(1, "COMPLETED", "c2")], [old])
    assert att.blames == []


def test_rule7_a_repaired_lemon_starts_clean() -> None:
    from gpuwarden.accounting.attribution import lemon_clears

    history = [job(i, "NODE_FAIL", "c1", start=T0 + i * 7200) for i in range(5)]
    resumed_at = T0 + 5 * 7200
    drain = ev("c1", T0 + 4 * 7200 + 3700, "DRAIN", "gpuwarden: lemon, 5 of 5 jobs failed",
               end=resumed_at)
    clears = lemon_clears([drain])
    assert clears == {"c1": pytest.approx(resumed_at)}
    after = [job(10, "COMPLETED", "c1", start=resumed_at + 100)]
    att = attribute(history + after, clears=clears)
    assert att.blames == [] and att.exposure["c1"].jobs == 1
    # Still drained (no end yet): the evidence stands.
    open_drain = ev("c1", T0 + 4 * 7200 + 3700, "DRAIN", "gpuwarden: lemon, 5 of 5")
    assert lemon_clears([open_drain]) == {}


def test_expected_failures_follow_the_sizes_of_a_nodes_runs() -> None:
    """A node that only runs big jobs (which fail more) is not a lemon for failing with them."""
    from gpuwarden.lemon.scoring import expected_failures

    jobs = []
    for i in range(200):  # 16-node jobs on b1-b16 fail 20% of the time, spread
        state = "FAILED" if i % 5 == 0 else "COMPLETED"
        jobs.append(job(i, state, "b[1-16]", start=T0 + i * 7200, exit_code=1))
    for i in range(200):  # one-node jobs elsewhere rarely fail
        jobs.append(job(1000 + i, "NODE_FAIL" if i == 0 else "COMPLETED", f"s{i % 20}",
                        start=T0 + i * 600))
    att = attribute(jobs)
    exp = expected_failures(att)
    assert exp["b1"] == pytest.approx(40.0)
    assert not [s.node for s in score(att) if s.lemon]


def test_history_merges_files_read_in_parallel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gpuwarden.accounting.history import from_files

    jobs = fleet_history({"n7"}, seed=4)
    paths = []
    for k in range(4):
        p = tmp_path / f"part{k}.json"
        p.write_text(sacct_export(jobs[k::4]))
        paths.append(str(p))
    one = from_files(paths, [], workers=1)
    two = from_files(paths, [], workers=2)
    assert one.records == two.records == 4004
    for h in (one, two):
        assert {n: e.jobs for n, e in h.attribution.exposure.items()} == {
            n: e.jobs for n, e in attribute(jobs).exposure.items()}
    assert [s.node for s in score(two.attribution) if s.lemon] == ["n7"]


def test_cluster_windows_count_each_run_once() -> None:
    """sacct lists a run in every day window it overlaps; it must count once."""
    from datetime import UTC, datetime, timedelta

    from gpuwarden.accounting.history import from_cluster

    now = datetime(2026, 11, 29, 12, tzinfo=UTC)
    long_run = job(1, "NODE_FAIL", "c1", start=int((now - timedelta(hours=30)).timestamp()),
                   hours=12)

    class Client:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def events(self, start: str, end: str) -> list[NodeEvent]:
            return []

        def acct_jobs(self, start: str, end: str):  # type: ignore[no-untyped-def]
            self.calls.append((start, end))
            return iter([long_run])  # overlaps both windows

    c = Client()
    h = from_cluster(c, timedelta(days=2), now=now)  # type: ignore[arg-type]
    assert len(c.calls) == 2 and h.attribution.exposure["c1"].jobs == 1
    assert len(h.attribution.blames) == 1


def windowed_export(jobs: list[AcctJob], start: str, end: str) -> str:
    import json

    doc = json.loads(sacct_export(jobs))
    doc["jobs"] = doc["jobs"][:-1]  # no malformed record here
    doc["meta"] = {"command": ["sacct", "--json", "--allusers", f"--starttime={start}",
                               "--endtime", end]}
    return json.dumps(doc)


def test_day_exports_count_a_run_that_crossed_midnight_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """sacct lists a run in every window it overlaps: the export's own window decides."""
    from datetime import UTC, datetime

    from gpuwarden.accounting.history import from_files

    midnight = int(datetime(2027, 1, 2, tzinfo=UTC).timestamp())
    crossing = job(1, "NODE_FAIL", "c1", start=midnight - 3600, hours=2)
    (tmp_path / "d1.json").write_text(windowed_export([crossing], "2027-01-01T00:00:00",
                                                      "2027-01-02T00:00:00"))
    (tmp_path / "d2.json").write_text(windowed_export([crossing], "2027-01-02T00:00:00",
                                                      "2027-01-03T00:00:00"))
    h = from_files([str(tmp_path / "d1.json"), str(tmp_path / "d2.json")], [], workers=1)
    assert h.attribution.exposure["c1"].jobs == 1 and len(h.attribution.blames) == 1


def test_the_same_export_given_twice_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gpuwarden.accounting.history import HistoryError, from_files

    p = tmp_path / "a.json"
    p.write_text(sacct_export([job(1, "COMPLETED", "c1")]))
    (tmp_path / "link.json").symlink_to(p)
    with pytest.raises(HistoryError, match="same file"):
        from_files([str(p), str(tmp_path / "link.json")], [])


def test_a_record_of_the_wrong_shape_is_skipped_not_a_crash(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from gpuwarden.accounting.history import from_files

    doc = json.loads(sacct_export([job(1, "COMPLETED", "c1")]))
    doc["jobs"].append({"job_id": 2, "nodes": "c2", "tres": {"allocated": 5},
                        "time": {"start": T0, "end": T0 + 5}})
    doc["jobs"].append({"job_id": 3, "nodes": "c2", "state": "RUNNING"})
    p = tmp_path / "odd.json"
    p.write_text(json.dumps(doc))
    h = from_files([str(p)], [])
    # The export's own id-less record and the one with a number for a list are malformed; the
    # one whose state is a string has no times either.
    assert h.attribution.skipped == {f"{p}: malformed record": 2, "no start or end time": 1}
    assert h.attribution.exposure["c1"].jobs == 1


def test_scan_with_since_and_from_together_is_a_usage_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config.context import Context

    p = tmp_path / "a.json"
    p.write_text(sacct_export([job(1, "COMPLETED", "c1")]))
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(p), "--since", "2d"],
                             obj=Context())
    assert res.exit_code == 2 and "export the window you want" in res.output
