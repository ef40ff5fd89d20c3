"""Fleet analytics (MTTF by size, projections, Young/Daly) and the calibrated simulator."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import Context, cli
from gpuwarden.fleet import calibrate, mttf
from gpuwarden.fleet.calibrate import CalibrationError, PaperFigures, solve
from gpuwarden.fleet.simulate import Fleet, write_history
from gpuwarden.lemon.attribution import attribute
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
    events = [ev("c9", during), ev("c8", during, "DRAIN", "gpuwarden: xid 79"),
              ev("c7", during, "DRAIN", "maintenance"),
              ev("c6", T0 - 86_400, "DRAIN", "gpuwarden: xid 48")]  # began before the history
    rep = mttf.report(attribute(jobs), events, 8, 30.0, (16_384,))
    by = {c.gpus: c for c in rep.classes}
    assert (by[8].runs, by[8].failures, by[8].mttf_h) == (3, 1, pytest.approx(20.0))
    assert (by[16].failures, by[16].mttf_h) == (1, pytest.approx(4.0))
    assert by[8].young_h == pytest.approx(mttf.young(30 / 3600, 20.0))
    # The health drain; not the DOWN, not the operator's drain, not one older than the history.
    assert rep.node_failures == 1
    assert rep.per_gpu_mttf_h == pytest.approx((20 * 8 + 4 * 16) / 2)  # GPU-hours / failures


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
    assert len(recs) == w.records > 500
    assert all(isinstance(r, AcctJob) for r in recs)
    states = {r.state for r in recs if isinstance(r, AcctJob)}
    assert {"COMPLETED", "NODE_FAIL", "FAILED", "CANCELLED", "TIMEOUT"} <= states
    events = parse.parse_events(w.events.read_text())
    assert events and {e.cluster for e in events} == {"sim"}
    assert json.loads(w.truth.read_text())["lemons"] == list(w.lemons)
    assert len(w.lemons) == round(0.012 * 300)
    again = write_history(solve(), Fleet(nodes=300, days=3, seed=7), tmp_path / "again")
    assert again.files[0].read_bytes() == w.files[0].read_bytes()  # a seed is a fleet


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
    bad = CliRunner().invoke(cli, ["fleet", "mttf", "--from", str(out / "sacct"),
                                   "--ckpt-cost", "soon"], obj=Context())
    assert bad.exit_code == 2 and "30s, 2m or 0.5h" in bad.output
