"""Fleet analytics (MTTF by size, projections, Young/Daly) and the calibrated simulator."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.accounting import calibrate, mttf
from gpuwarden.accounting.attribution import attribute
from gpuwarden.accounting.calibrate import CalibrationError, PaperFigures, solve
from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.fleet.simulate import Fleet, write_history
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import AcctJob
from tests.unit.test_lemon_core import T0, ev, job


def test_young_and_daly_intervals() -> None:
    cost, m = 30 / 3600, 7.9
    assert mttf.young(cost, m) == pytest.approx(0.36286, rel=1e-4)
    assert mttf.daly(cost, m) == pytest.approx(0.35732, rel=1e-4)
    assert mttf.daly(10.0, 4.0) == 4.0  # checkpoints dearer than twice the MTTF: run to failure


def test_mttf_by_size_counts_only_infrastructure_failures() -> None:
    def gjob(jid: int, state: str, nodes: str, gpus: int, hours: float) -> AcctJob:
        return replace(job(jid, state, nodes, start=T0 + jid * 10_000, hours=hours, exit_code=1),
                       gpus=gpus)
    jobs = [gjob(1, "COMPLETED", "c1", 8, 10), gjob(2, "NODE_FAIL", "c2", 8, 5),
            gjob(3, "FAILED", "c3", 8, 5),  # the user's: not a failure of the fleet
            gjob(4, "FAILED", "c[1-2]", 16, 2), gjob(5, "COMPLETED", "c[3-4]", 16, 2)]
    during = T0 + 15_000
    events = [ev("c9", during), ev("c8", during, "DRAIN", "gpuwarden: xid 79 [health]"),
              ev("c7", during, "DRAIN", "maintenance"),
              ev("c6", T0 - 86_400, "DRAIN", "gpuwarden: xid 48 [health]")]  # began before the history
    rep = mttf.report(attribute(jobs), events, 8, 30.0, (16_384,))
    by = {c.gpus: c for c in rep.classes}
    assert (by[8].runs, by[8].failures, by[8].mttf_h) == (3, 1, pytest.approx(20.0))
    assert (by[16].failures, by[16].mttf_h) == (1, pytest.approx(4.0))
    assert by[8].young_h == pytest.approx(mttf.young(30 / 3600, 20.0))
    # The health drain; not the DOWN, not the operator's drain, not one older than the history.
    assert rep.node_failures == 1
    assert rep.per_gpu_mttf_h == pytest.approx((20 * 8 + 4 * 16) / 2)  # GPU-hours / failures


def test_a_report_carries_the_papers_figures_beside_its_own() -> None:
    def gjob(jid: int, state: str, gpus: int) -> AcctJob:
        return replace(job(jid, state, "c[1-2]", start=T0 + jid * 10_000, hours=2.0,
                           exit_code=1), gpus=gpus)
    jobs = [gjob(1, "COMPLETED", 8), gjob(2, "NODE_FAIL", 512), gjob(3, "COMPLETED", 1024),
            gjob(4, "COMPLETED", 64)]
    rep = mttf.report(attribute(jobs), [], 8, 30.0, (16_384, 2_048))
    by = {c.gpus: c for c in rep.classes}
    assert by[8].paper_mttf_h == pytest.approx(47.7 * 24) and by[1024].paper_mttf_h == 7.9
    assert by[64].paper_mttf_h is None and by[512].paper_mttf_h is None
    assert [p.paper_h for p in rep.projections] == [1.8, None]
    assert (rep.big_runs, rep.big_failures) == (2, 1)  # the 512 and 1024 classes


def test_calibration_reproduces_every_published_figure_in_expectation() -> None:
    p = solve()
    fig = PaperFigures()
    assert calibrate.mttf_h(p, 8) / 24 == pytest.approx(fig.mttf_8gpu_days, rel=1e-6)
    assert calibrate.mttf_h(p, 1024) == pytest.approx(fig.mttf_1024gpu_h, rel=1e-6)
    assert calibrate.node_rate(p) == pytest.approx(fig.node_rate, rel=1e-6)
    assert 24 / (16_384 / 8 * calibrate.node_rate(p)) == pytest.approx(1.8, rel=1e-6)
    assert 24 / (131_072 / 8 * calibrate.node_rate(p)) == pytest.approx(0.23, rel=0.05)
    assert calibrate.big_fail(p, True) == pytest.approx(0.14, rel=1e-4)
    assert calibrate.big_fail(p, False) == pytest.approx(0.04, rel=1e-4)
    assert min(p.normal_rate, p.transient_rate, p.fabric_rate) >= 0


def test_impossible_targets_are_a_clear_error() -> None:
    with pytest.raises(CalibrationError, match="1024-GPU MTTF"):
        solve(PaperFigures(mttf_1024gpu_h=48 * 24))


def test_the_simulated_history_is_sacct_json_the_real_parser_reads(tmp_path: Path) -> None:
    w = write_history(solve(), Fleet(nodes=300, days=3, seed=7), tmp_path)
    recs = [r for f in w.files for r in parse.iter_acct_jobs(f.read_text())]
    assert all(isinstance(r, AcctJob) for r in recs)
    assert len({r.job_id for r in recs if isinstance(r, AcctJob)}) == w.records > 500
    states = {r.state for r in recs if isinstance(r, AcctJob)}
    assert {"COMPLETED", "NODE_FAIL", "FAILED", "CANCELLED", "TIMEOUT"} <= states
    events = parse.parse_events(w.events.read_text())
    assert events and {e.cluster for e in events} == {"sim"}
    assert json.loads(w.truth.read_text())["lemons"] == list(w.lemons)
    assert len(w.lemons) == round(0.012 * 300)
    again = write_history(solve(), Fleet(nodes=300, days=3, seed=7), tmp_path / "again")
    assert again.files[0].read_bytes() == w.files[0].read_bytes()  # a seed is a fleet


def _shape_fits(ours: object, real: object, path: str = "") -> list[str]:
    """Where ``ours`` has a field the real record lacks, or one of another JSON type."""
    if isinstance(ours, dict) and isinstance(real, dict):
        out = []
        for key, value in ours.items():
            if key in real:
                out.extend(_shape_fits(value, real[key], f"{path}.{key}"))
            else:
                out.append(f"{path}.{key}: not in the real record")
        return out
    if isinstance(ours, list) and isinstance(real, list):
        return _shape_fits(ours[0], real[0], f"{path}[]") if ours and real else []
    if type(ours) is type(real):
        return []
    return [f"{path}: {type(ours).__name__}, real {type(real).__name__}"]


FIXTURE = Path(__file__).parent.parent / "fixtures" / "sacct.json"


def slurm_layout(doc: object) -> str:
    """How Slurm 24.11 lays out `sacct --json` (the captured fixture is exactly this): two-space
    indents, and every "/" escaped."""
    return json.dumps(doc, indent=2).replace("/", "\\/") + "\n"


def test_simulated_day_files_are_what_sacct_prints_for_a_day(tmp_path: Path) -> None:
    real_text = FIXTURE.read_text()
    real = json.loads(real_text)
    assert real_text == slurm_layout(real)  # the rule holds for Slurm's own output
    fleet = Fleet(nodes=300, days=3, seed=7)
    w = write_history(solve(), fleet, tmp_path)
    day2 = w.files[1].read_text()
    doc = json.loads(day2)
    assert day2 == slurm_layout(doc)
    assert list(doc) == list(real)  # jobs, meta, errors, warnings, in Slurm's order
    assert _shape_fits({"job_id": "1", "gres": 1}, real["jobs"][0]) == [
        ".job_id: str, real int", ".gres: not in the real record"]  # the check can fail
    assert _shape_fits(doc["jobs"][0], real["jobs"][0]) == []
    assert _shape_fits(doc["meta"], real["meta"]) == []
    lo = fleet.start + 86_400
    # The export's own command line names its day, as the documented export loop makes it.
    assert doc["meta"]["command"][:5] == ["sacct", "--json", "--allusers", "--allocations",
                                          "--duplicates"]
    assert parse.acct_window(doc) == (lo, lo + 86_400)


def test_a_run_that_crossed_midnight_is_in_both_days_and_counted_once(tmp_path: Path) -> None:
    from gpuwarden.accounting.history import from_files, read_events

    fleet = Fleet(nodes=300, days=3, seed=7)
    w = write_history(solve(), fleet, tmp_path)
    days = [{r.job_id: r for r in parse.iter_acct_jobs(f.read_text())
             if isinstance(r, AcctJob)} for f in w.files]
    end = fleet.start + 3 * 86_400
    crossed = {j for j, r in days[0].items()
               if r.end_time is not None and r.end_time >= fleet.start + 86_400}
    assert crossed and crossed <= set(days[1])  # sacct lists a run in every day it overlaps
    runs = {j: r for d in days for j, r in d.items()}
    ended = sum(1 for r in runs.values() if r.end_time is not None and r.end_time < end)
    hist = from_files([str(f) for f in w.files], read_events(str(w.events)))
    assert hist.records == ended  # each once, in the day it ended; none still running counted
    assert 0 < len(runs) - ended < len(runs) // 10


def test_the_events_export_starts_with_the_cluster_registering(tmp_path: Path) -> None:
    w = write_history(solve(), Fleet(nodes=300, days=2, seed=7), tmp_path)
    events = parse.parse_events(w.events.read_text())
    assert (events[0].node, events[0].reason, events[0].end) == ("", "Cluster Registered TRES",
                                                                 "Unknown")
    assert {e.user for e in events[1:]} <= {"root", "admin"}


def test_no_run_lands_on_an_excluded_node(tmp_path: Path) -> None:
    excluded = frozenset({"n0005", "n0100"})
    w = write_history(solve(), Fleet(nodes=200, days=2, exclude=excluded), tmp_path)
    from gpuwarden.slurm.hostlist import expand

    for f in w.files:
        for r in parse.iter_acct_jobs(f.read_text()):
            assert isinstance(r, AcctJob) and not set(expand(r.nodes)) & excluded


def test_simulated_fleet_matches_the_paper_and_the_detector_finds_its_lemons() -> None:
    from gpuwarden.fleet.compare import compare

    rows = {r.figure: r.simulated for r in compare(solve(), nodes=1000, days=30, seeds=1)}
    assert rows["detector recall / precision"] in ("1.00 / 1.00",) or float(
        rows["detector recall / precision"].split(" / ")[0]) >= 0.9
    proj = float(rows["projected MTTF, 16,384 GPUs"].split()[0])
    assert proj == pytest.approx(1.8, rel=0.25)
    m1024 = float(rows["MTTF of 1024-GPU jobs"].split()[0])
    assert m1024 == pytest.approx(7.9, rel=0.3)
    with_l = float(rows[">=512-GPU job failure rate, lemons in service"].rstrip("%"))
    without = float(rows[">=512-GPU job failure rate, flagged lemons drained"].rstrip("%"))
    assert without < with_l / 2


def test_fleet_mttf_and_simulate_commands(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    res = CliRunner().invoke(cli, ["simulate", "--nodes", "500", "--days", "10", "--no-compare",
                                   "--out", str(out)], obj=Context())
    assert res.exit_code == 0, res.output
    assert "gpuwarden lemon scan --from" in res.stdout
    res = CliRunner().invoke(cli, ["fleet", "mttf", "--from", str(out / "sacct"), "--events",
                                   str(out / "events.txt"), "--ckpt-cost", "45s"], obj=Context())
    assert res.exit_code == 0, res.output
    assert "<=1024" in res.stdout and "checkpoint cost 45 s" in res.stdout
    assert "per 1000 node-days" in res.stdout and "16384 GPUs" in res.stdout
    # Meta's published figures beside the site's, on the rows where the paper gives one.
    mttf_part = res.stdout.split("HOT SPARES")[0]  # the spares' table follows, by size too
    rows = {line.split()[0]: line for line in mttf_part.splitlines() if line.strip()}
    assert "META (PAPER)" in rows["GPUS"]
    assert rows["<=8"].endswith(" 47.7 d") and rows["<=1024"].endswith(" 7.9 h")
    assert rows["<=16"].endswith(("h", "d", "min", "-")) and "47.7" not in rows["<=16"]
    assert rows["16384"].endswith(" 1.8 h") and rows["131072"].endswith(" 13.8 min")
    assert "Meta (paper): 14% with lemons in service, 4% with them drained" in res.stdout
    assert "Meta (paper): 6.51, implied by its 1.8 h projection" in res.stdout
    assert "Kokolis et al." in res.stdout
    js = CliRunner().invoke(cli, ["fleet", "mttf", "--from", str(out / "sacct"), "--events",
                                  str(out / "events.txt"), "--json"], obj=Context())
    doc = json.loads(js.stdout)
    by = {c["gpus"]: c for c in doc["classes"]}
    assert by[8]["paper_mttf_h"] == pytest.approx(47.7 * 24) and by[16]["paper_mttf_h"] is None
    assert doc["paper"]["projection_16k_h"] == 1.8
    bad = CliRunner().invoke(cli, ["fleet", "mttf", "--from", str(out / "sacct"),
                                   "--ckpt-cost", "soon"], obj=Context())
    assert bad.exit_code == 2 and "30s, 2m or 0.5h" in bad.output


def test_fleet_mttf_says_per_size_whether_spares_pay_off(tmp_path: Path) -> None:
    # Issue 18: `gpuwarden fleet`, not only the report, answers it at the site's own MTTF.
    from gpuwarden.fleet.spares import payoff
    # 10 job-hours of 2-node (16-GPU) jobs with 3 failures; k=1 at 8 GPUs per node idles
    # 10 x 1 x 8 = 80 GPU-h; requeues of u0 = 2 h against s = 0.1 h lose 3 x 1.9 x 16 = 91.2.
    p = payoff(2, 10.0, 3, 16.0, 1, 8, 2.0, 0.1)
    assert p is not None and p.idle_gpu_h == 80.0 and round(p.requeue_lost_gpu_h, 1) == 91.2
    assert p.pays
    assert payoff(1, 10.0, 3, 8.0, 1, 8, 2.0, 0.1) is None  # one node: no spare
    out = tmp_path / "sim"
    res = CliRunner().invoke(cli, ["simulate", "--nodes", "500", "--days", "10", "--no-compare",
                                   "--out", str(out)], obj=Context())
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["fleet", "mttf", "--from", str(out / "sacct"), "--events",
                                   str(out / "events.txt"), "--spares", "2", "--restart-cost",
                                   "99s", "--spare-swap", "8s"], obj=Context())
    assert res.exit_code == 0, res.output
    assert "HOT SPARES, k=2 per job (a requeue costs u0=99 s, a spare's take-over s=8 s" in \
        res.stdout
    assert "PAY OFF" in res.stdout
    rep_json = CliRunner().invoke(cli, ["fleet", "mttf", "--from", str(out / "sacct"),
                                        "--events", str(out / "events.txt"), "--json"],
                                  obj=Context())
    doc = json.loads(rep_json.stdout)
    sizes = doc["spares"]["sizes"]
    assert sizes and all(s["gpus"] > 8 for s in sizes)
    assert {"idle_gpu_h", "requeue_lost_gpu_h", "pays"} <= set(sizes[0])

