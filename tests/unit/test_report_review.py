"""The report's defects a hostile review found (review 16), one test each: small histories
whose right answer is worked out by hand in the comments."""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwarden.accounting.attribution import attribute, health_drains, lemon_clears, node_failures
from gpuwarden.accounting.history import History
from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report.build import Options, Report, as_dict, as_json, build
from gpuwarden.report.collect import Blamable, RunTally
from gpuwarden.report.drains import drains
from gpuwarden.report.render import render
from gpuwarden.report.text import cleaned
from gpuwarden.slurm.models import AcctJob, Node, NodeEvent

T0 = 1_767_225_600  # 2026-01-01T00:00:00Z
H = 3600
DAY = 86_400


def job(i: int, state: str, nodes: str, gpus: int, start: int, secs: int, part: str = "p",
        count: int = 1, exit_code: int = 0) -> AcctJob:
    return AcctJob(i, "j", "u", state, "", part, nodes, count, gpus, exit_code, None, None,
                   start, start + secs, 0)


def ev(node: str, start: str, end: str, state: str, reason: str, cluster: str = "c") -> NodeEvent:
    return NodeEvent(cluster, node, start, end, state, reason, "root")


def report(jobs: list[AcctJob], events: list[NodeEvent] | tuple[NodeEvent, ...] = (),
           opts: Options | None = None) -> Report:
    tally = RunTally()
    tally.add(jobs)
    att = attribute(jobs, health_drains(events), failures=node_failures(events),
                    clears=lemon_clears(events))
    return build(History(att, len(jobs), tuple(events), tally), opts or Options("t"),
                 ScoreConfig())


def doc(r: Report) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(as_json(r))
    return out


# 1 -------------------------------------------------------------------------------------------
def test_fleet_ettr_weighs_sizes_by_gpu_hours_and_gives_one_node_jobs_no_spare() -> None:
    # 1-GPU class: 100 runs of 1 h, no failure. 16-GPU class (2 nodes): 10 runs of 10 h, 5 of
    # them NODE_FAIL at their end. tau = 1 h, C = 0, u0 = 0, s = 0, k = 1.
    jobs = [job(i, "COMPLETED", f"a{i % 4}", 1, T0 + i * 60, H) for i in range(100)]
    jobs += [job(200 + i, "NODE_FAIL" if i < 5 else "COMPLETED", "n[1-2]", 16, T0 + i * 11 * H,
                 10 * H, count=2) for i in range(10)]
    r = report(jobs, opts=Options("t", ckpt_cost_s=0, interval_h=1.0, restart_h=0.0, swap_h=0.0))
    one, sixteen = r.ettr.rows
    # 1 GPU: ETTR 1.0 today; one node: no spare, so still 1.0 (not 1/2).
    assert (one.ettr_now, one.ettr_spares) == (1.0, 1.0)
    # 16 GPUs: (100 - 5 * 0.5) / 100 = 0.975.
    assert sixteen.ettr_now == 0.975
    # By GPU-hours: (100 * 1 * 1.0 + 100 * 16 * 0.975) / (100 + 1600) = 1660 / 1700 = 0.9765
    # (by wall hours it would be (100 + 97.5) / 200 = 0.9875).
    assert r.ettr.fleet_now == 0.9765
    assert "weighted by GPU-hours" in render(r)


# 2 -------------------------------------------------------------------------------------------
def test_hardware_class_is_the_mttf_failures_and_never_ran_is_apart() -> None:
    jobs = [job(1, "COMPLETED", "n1", 8, T0, 10 * H),
            job(2, "NODE_FAIL", "c1", 0, T0, 2 * H),  # no GPUs: not in the MTTF section
            job(3, "BOOT_FAIL", "None assigned", 8, T0, 0),  # no node: not a run
            job(4, "NODE_FAIL", "n[1-", 8, T0, 60)]  # unreadable: skipped
    # A 1,000-task array cancelled while pending, in the requested partitions "a,b".
    jobs += [AcctJob(10 + i, "j", "u", "CANCELLED", "", "a,b", "None assigned", 0, 0, 0, None,
                     T0, T0 + 7200, T0 + 7200, 0) for i in range(1000)]
    d = doc(report(jobs))
    assert d["outcomes"]["totals"]["hardware"] == d["mttf"]["failures"] == 0
    assert d["outcomes"]["runs"] == sum(c["runs"] for c in d["mttf"]["classes"]) == 1
    assert [p["partition"] for p in d["outcomes"]["partitions"]] == ["p"]
    assert (d["outcomes"]["never_ran"], d["outcomes"]["cpu_runs"]) == (1000, 1)


# 3 -------------------------------------------------------------------------------------------
def test_page_says_gang_failed_runs_count_and_how_many_had_no_node_event() -> None:
    # 12 two-node runs exit 1 after 10 min; the 12th had a node go down at its end.
    jobs = [job(i, "FAILED", f"n[{2 * i}-{2 * i + 1}]", 16, T0 + i * H, 600, count=2,
                exit_code=1) for i in range(12)]
    events = [ev("n22", "2026-01-01T11:10:00", "2026-01-01T12:00:00", "DOWN", "Not responding")]
    r = report(jobs, events)
    assert r.mttf.failures == 12 and r.mttf.gang_failed_no_event == 11
    page = " ".join(render(r).split())
    assert "user's own failures do not count" not in page
    assert "every run on more than one node that FAILED" in page
    assert "11 are such gang runs with no node event" in page


# 4 -------------------------------------------------------------------------------------------
def test_a_failure_loses_no_more_work_than_its_run_had_done() -> None:
    # 16 GPUs: 10 runs of 10 h complete; 40 die 20 s in. tau = 1 h, C = 30 s, u0 = 0.
    jobs = [job(i, "COMPLETED", "n[1-2]", 16, T0 + i * H, 10 * H, count=2) for i in range(10)]
    jobs += [job(100 + i, "NODE_FAIL", "n[3-4]", 16, T0 + i * 600, 20, count=2)
             for i in range(40)]
    r = report(jobs, opts=Options("t", interval_h=1.0, restart_h=0.0))
    h = 100 + 40 * 20 / 3600
    # Lost: 40 x 20 s, not 40 x 30 min; stall H x 30 s / 1 h.
    assert r.ettr.rows[0].ettr_now == round((h - 40 * 20 / 3600 - h * 30 / 3600) / h, 4)


# 5 -------------------------------------------------------------------------------------------
def test_collector_keeps_nothing_of_failed_runs_no_event_can_explain() -> None:
    def tally(n: int) -> tuple[int, int]:
        jobs = [job(i, "FAILED", f"n{i % 2000}", 8, T0 + i, 600, exit_code=1) for i in range(n)]
        # One health drain: the one run on n7 that it overlaps may be blamed (rule 4).
        events = [ev("n7", "2026-01-01T00:00:10", "2026-01-01T01:00:00", "DRAIN",
                     "gpuwarden: x [health]")]
        tracemalloc.start()
        t = RunTally(blamable=Blamable.of(events))
        t.add(jobs)
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(t.blamable) == 1
        return size, len(t.blamable)

    small, _ = tally(20_000)
    big, _ = tally(80_000)
    assert big < small + 200_000  # not 140 B per record


def test_kept_failed_runs_are_every_run_the_attribution_blames() -> None:
    events = [ev("n7", "2026-01-01T00:05:00", "2026-01-01T01:00:00", "DRAIN",
                 "gpuwarden: x [health]"),
              ev("n9", "2026-01-01T02:10:00", "2026-01-01T03:00:00", "DOWN", "Not responding")]
    jobs = [job(1, "FAILED", "n7", 8, T0, 600, exit_code=1),  # rule 4: drained while it ran
            job(2, "FAILED", "n8", 8, T0, 600, exit_code=1),  # the user's
            job(3, "REQUEUED", "n9", 8, T0 + H, 4200),  # rule 2: n9 went down at its end
            job(4, "REQUEUED", "n8", 8, T0 + H, 600),  # nobody's
            job(5, "FAILED", "n[1-2]", 16, T0, 600, count=2, exit_code=1)]  # rule 3
    t = RunTally(blamable=Blamable.of(events))
    t.add(jobs)
    hist = History(attribute(jobs, health_drains(events), failures=node_failures(events)),
                   len(jobs), tuple(events), t)
    d = doc(build(hist, Options("t"), ScoreConfig()))
    assert len(t.blamable) == d["mttf"]["failures"] == 3
    assert d["outcomes"]["unmatched_blames"] == 0


# 6 -------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    nodes_: list[Node]
    jobs: list[AcctJob] = field(default_factory=list)

    def nodes(self) -> list[Node]:
        return self.nodes_

    def events(self, start: str, end: str) -> list[NodeEvent]:
        return []

    def acct_jobs(self, start: str, end: str) -> Iterator[AcctJob]:
        return iter(self.jobs)


def test_report_of_the_live_cluster_lists_nodes_whose_gating_is_off_or_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text("")
    monkeypatch.setenv("GPUWARDEN_CONFIG", str(cfg))
    import time

    now = int(time.time())
    fresh = json.dumps({"gpuwarden_health": {"at": now - 60, "st": "OK", "off": "", "since": 0}})
    off = json.dumps({"gpuwarden_health": {"at": now - 60, "st": "OK", "off": "config",
                                           "since": now - 3600}})

    def node(name: str, extra: str) -> Node:
        return Node(name, ("IDLE",), "", "", None, ("gpu",), "gpu:h100:8", (), None, extra=extra)

    client = Cluster([node("g1", fresh), node("g2", off), node("g3", "")])
    ctx = Context(config_path=str(cfg), client_factory=lambda c: client)  # type: ignore[arg-type,return-value]
    out = tmp_path / "r.html"
    res = CliRunner().invoke(cli, ["report", "--since", "1d", "-o", str(out), "--json",
                                   str(tmp_path / "r.json")], obj=ctx)
    assert res.exit_code == 0, res.output
    g = json.loads((tmp_path / "r.json").read_text())["gating"]
    assert g["available"] and g["nodes_read"] == 3
    assert [row["node"] for row in g["flagged"]] == ["g2", "g3"]
    page = out.read_text()
    assert "needs the live cluster" not in page and "health gating off since" in page
    assert "in Slurm (its Extra field" in page


def test_report_of_files_says_where_gating_state_is() -> None:
    page = " ".join(render(report([job(1, "COMPLETED", "n1", 8, T0, H)])).split())
    page = page.replace("&#39;", "'")
    gating = page[page.index('id="gating"'):]
    assert "in Slurm (the node's Extra field" in gating and "on the nodes" not in gating


# 7 -------------------------------------------------------------------------------------------
def test_one_count_of_health_drains_and_came_with_counted_directly() -> None:
    jobs = [job(1, "COMPLETED", "n2", 8, T0, 10 * H)]
    events = [ev("n1", "2026-01-01T01:00:00", "2026-01-01T01:30:00", "DRAIN",
                 "gpuwarden: xid 79 [health]"),
              ev("n1", "2026-01-01T02:00:00", "2026-01-01T03:00:00", "DRAIN", "gpuwarden: lemon"),
              ev("n3", "2026-01-01T03:00:00", "2026-01-01T04:00:00", "DOWN",
                 "gpuwarden: xid 48 [health]"),
              ev("n4", "2026-01-01T10:30:00", "2026-01-01T11:00:00", "DRAIN",
                 "gpuwarden: ecc [health]")]
    r = report(jobs, events)
    f = {x.label: x.value for x in r.tradeoffs[2].figures}
    # Only the n1 xid drain is a node failure (the MTTF's count): a DRAIN, not a lemon's,
    # inside the history; no failed run came with it.
    assert f["health-gating drains (the MTTF section's node failures)"] == r.mttf.node_failures == 1
    assert f["drains that came with a failed run (the failure came first)"] == 0
    assert f["drains with no failed run behind them (found before a job failed)"] == 1


# 8 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [r"$\frac{a}$", "$x$", "gpu\ud800"])
def test_any_partition_name_renders_as_text(name: str) -> None:
    jobs = [job(1, "FAILED", "n1", 8, T0, H, part=name, exit_code=1),
            job(2, "COMPLETED", "n2", 8, T0, 2 * H, part=name)]
    r = report(jobs)
    page = render(r)
    page.encode("utf-8")
    as_json(r).encode("utf-8")
    shown = name.replace("\ud800", "\N{REPLACEMENT CHARACTER}")
    assert f"partition {shown}" in page.replace("&#39;", "'").replace("&amp;", "&")


# 9 -------------------------------------------------------------------------------------------
def test_mttf_of_runs_that_fail_at_launch_is_not_zero() -> None:
    jobs = [job(i, "NODE_FAIL", "n[1-2]", 16, T0 + i * 60, 5, count=2) for i in range(30)]
    c = report(jobs).mttf.classes[0]
    # 30 runs x 5 s = 150 s = 0.04167 h over 30 failures: 0.001389 h.
    assert c.mttf_h == 0.00139 and c.job_hours == 0.0417
    assert c.mttf_low_h is not None and c.mttf_high_h is not None
    assert 0 < c.mttf_low_h < c.mttf_h < c.mttf_high_h


# 10 ------------------------------------------------------------------------------------------
def test_ettr_chart_draws_no_bar_for_a_missing_value() -> None:
    from gpuwarden.report.charts import ettr_chart

    # 8 GPUs: no failure, so no Daly value; 16 GPUs: a failure.
    jobs = [job(1, "COMPLETED", "n1", 8, T0, 10 * H),
            job(2, "NODE_FAIL", "n[2-3]", 16, T0, 5 * H, count=2)]
    r = report(jobs)
    assert r.ettr.rows[0].ettr_daly is None and r.ettr.rows[1].ettr_daly is not None
    patches = re.compile(r'<g id="ettr-patch_\d+">')
    drawn = len(patches.findall(ettr_chart(r.ettr)))
    # The same rows with the missing value filled in: one bar more (not the same count, as
    # when a missing value was drawn as a bar of height 0).
    rows = [r.ettr.rows[0].__class__(**{**asdict(r.ettr.rows[0]), "ettr_daly": 0.5}),
            r.ettr.rows[1]]
    assert len(patches.findall(ettr_chart(replace(r.ettr, rows=rows)))) == drawn + 1
    assert "sizes with no failure count at today&#39;s τ" in render(r)


# 11 ------------------------------------------------------------------------------------------
def _history(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    src = json.loads(Path("tests/fixtures/sacct.json").read_text())
    (d / "a.json").write_text(json.dumps(src))
    return d


def _report(*args: str) -> Any:
    return CliRunner().invoke(cli, ["report", *args], obj=Context())


def test_sub_second_and_exact_checkpoint_intervals(tmp_path: Path) -> None:
    src = _history(tmp_path)
    for given, seconds in (("0.1s", 0.1), ("1s", 1)):
        js = tmp_path / "r.json"
        res = _report("--from", str(src), "-o", str(tmp_path / "r.html"), "--json", str(js),
                      "--ckpt-interval", given)
        assert res.exit_code == 0, res.output
        assert json.loads(js.read_text())["ettr"]["assumptions"]["interval_s"] == seconds
    res = _report("--from", str(src), "-o", str(tmp_path / "r.html"), "--ckpt-interval", "0s")
    assert res.exit_code == 2 and "must be more than 0 s" in res.output


# 12 ------------------------------------------------------------------------------------------
def test_drains_count_inside_the_window_one_cluster_and_each_hour_once() -> None:
    evs = [ev("n1", "2026-01-03T00:00:00", "Unknown", "DRAIN", "maint"),  # after the window
           ev("n2", "2026-01-01T00:00:00", "Unknown", "DRAIN", "maint", cluster="a"),
           ev("n2", "2026-01-01T06:00:00", "2026-01-01T12:00:00", "DRAIN", "gpuwarden: x [health]",
              cluster="a"),
           ev("n2", "2026-01-01T00:00:00", "Unknown", "DRAIN", "maint", cluster="b")]
    d = drains(evs, T0, T0 + DAY)
    assert d.cluster == "a" and d.other_clusters == {"b": 1, "c": 1}
    assert d.open_events == 1
    # n2 is out all day: 24 node-hours, to the operator whose drain began first.
    assert d.node_hours["operator"] == [24.0] and d.total_node_hours["health"] == 0.0


# 13 ------------------------------------------------------------------------------------------
def test_outputs_are_distinct_atomic_and_never_written_through_a_link(tmp_path: Path) -> None:
    src = _history(tmp_path)
    same = tmp_path / "same"
    res = _report("--from", str(src), "-o", str(same), "--json", str(same))
    assert res.exit_code == 2 and "same file" in res.output and not same.exists()
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    link = tmp_path / "link.html"
    os.symlink(target, link)
    res = _report("--from", str(src), "-o", str(link))
    assert res.exit_code == 0, res.output
    assert target.read_text() == "precious" and not link.is_symlink()
    assert link.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_failed_write_leaves_the_previous_report(tmp_path: Path) -> None:
    src = _history(tmp_path)
    old = tmp_path / "r.html"
    old.write_text("yesterday")
    # The JSON cannot be written (no such directory): the page is not replaced either.
    res = _report("--from", str(src), "-o", str(old), "--json", str(tmp_path / "no" / "r.json"))
    assert res.exit_code == 1 and old.read_text() == "yesterday"


# 14 ------------------------------------------------------------------------------------------
def test_long_histories_bin_by_week_with_the_year_and_unique_ids() -> None:
    # Two years of one run a day, and a drain every day.
    jobs = [job(i, "FAILED", "n1", 8, T0 - 365 * DAY + i * DAY, H, exit_code=1)
            for i in range(730)]
    events = [ev("n1", f"{2025 + i // 365}-01-01T00:00:00", f"{2025 + i // 365}-01-01T02:00:00",
                 "DRAIN", "maint") for i in (0, 400)]
    r = report(jobs, events)
    assert r.outcomes.bin_days == r.drains.bin_days == 7
    assert len(r.drains.days) == len(r.outcomes.bins)
    page = render(r)
    assert "node-hours per week" in page and "year-month-day" in page
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))
    text = " ".join(page.split())
    assert f"{r.mttf.gpu_hours} GPU-hours" in text
    assert "the size's upper bound in nodes" in text


# A second review -------------------------------------------------------------------------------
def test_a_hand_gpuwarden_drain_is_an_operators_not_a_node_failure() -> None:
    # `gpuwarden drain n4 --reason "replacing PSU"` stores "gpuwarden: replacing PSU": it was
    # counted as health gating's (r_f, the proactive card, health drain-hours) and made a
    # user's one-node failure on n4 the hardware's by rule 4.
    jobs = [job(1, "FAILED", "n4", 8, T0, H, exit_code=1),
            job(2, "COMPLETED", "n2", 8, T0, 10 * H)]
    events = [ev("n4", "2026-01-01T00:30:00", "2026-01-01T05:00:00", "DRAIN",
                 "gpuwarden: replacing PSU")]
    r = report(jobs, events)
    assert r.mttf.node_failures == 0
    f = {x.label: x.value for x in r.tradeoffs[2].figures}
    assert f["health-gating drains (the MTTF section's node failures)"] == 0
    assert r.drains.events.get("health", 0) == 0 and r.drains.events["operator"] == 1
    assert sum(c.failures for c in r.mttf.classes) == 0  # the user's failure stays the user's


def test_a_partition_name_with_hashes_is_shown_as_it_is_in_its_chart() -> None:
    # The id rewrite renamed every "#word" in the SVG, text included: the chart's title
    # read "#outcomes-0-figure_1" for partition "#figure_1".
    name = "#figure_1 #patch_1"
    jobs = [job(1, "FAILED", "n1", 8, T0, H, part=name, exit_code=1),
            job(2, "COMPLETED", "n2", 8, T0, 2 * H, part=name)]
    page = render(report(jobs))
    titles = re.findall(r"<text[^>]*>[^<]*figure_1[^<]*</text>", page)
    assert titles and all(name in t for t in titles), titles
    assert "#outcomes-0-figure_1" not in page
    # References are still the chart's own.
    assert re.search(r'clip-path="url\(#outcomes-0-', page)


def test_decades_of_history_make_at_most_max_bins_bars() -> None:
    from gpuwarden.report.bins import MAX_BINS, bin_days, unit
    assert bin_days(92) == 1 and bin_days(93) == 7 and bin_days(7 * MAX_BINS) == 7
    step = bin_days(40 * 365)
    assert step % 7 == 0 and -(-40 * 365 // step) <= MAX_BINS
    assert unit(step) == f"{step // 7} weeks"


def test_a_short_drain_is_not_rounded_away() -> None:
    # One decimal made a 4-second drain 0.0 node-hours: an event counted, an empty chart.
    jobs = [job(1, "COMPLETED", "n2", 8, T0, 10 * H)]
    events = [ev("n4", "2026-01-01T01:00:00", "2026-01-01T01:00:04", "DRAIN", "maintenance")]
    d = report(jobs, events).drains
    assert d.events["operator"] == 1
    assert d.total_node_hours["operator"] == pytest.approx(4 / 3600, rel=0.01)


def test_the_json_is_the_report_whichever_way_it_is_written() -> None:
    """The JSON msgspec writes (the fast way, a year's report) holds what the standard
    library's walk gives, lemon evidence, tradeoff cards and all."""
    events = [ev("n1", "2026-01-01T05:00:00", "2026-01-01T06:00:00", "DRAIN",
                 "gpuwarden: epilog: xid 79 on GPU 0 [health]")]
    jobs = [job(i, "FAILED" if i % 3 == 0 else "COMPLETED", f"n{i % 4 + 1}", 8, T0 + i * H, H,
                exit_code=1 if i % 3 == 0 else 0) for i in range(1, 40)]
    r = report(jobs, events)
    slow = json.loads(json.dumps(cleaned(asdict(r)), ensure_ascii=False))
    assert doc(r) == slow
    assert json.loads(json.dumps(as_dict(r))) == slow
