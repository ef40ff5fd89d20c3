"""Issue 39 item 5: `fleet mttf` and `report` on a cluster younger than --since.

A plain 3-node site registered four hours ago: `--since 30d` (the default) asks for 30 days,
but slurmdbd holds four hours. The window really read starts at the first thing the cluster
recorded (its registration, a node event, a run), so node-days are 3 x 4 h = 0.5, not 90;
and the health-gating drains are said the same way everywhere: how many count as node
failures (r_f), how many as job failures, and why the others do not.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwarden.accounting import history
from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.slurm.models import AcctJob, Node, NodeEvent

H = 3600


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def run(i: int, state: str, node: str, start: float, secs: int, gpus: int = 8) -> AcctJob:
    return AcctJob(i, "train", "alice", state, "", "gpu", node, 1, gpus,
                   1 if state == "FAILED" else 0, None, int(start) - 5, int(start),
                   int(start) + secs, 0)


def registered(at: float) -> NodeEvent:
    return NodeEvent("plain", "", iso(at), "Unknown", "", "Cluster Registered TRES", "")


def health_drain(node: str, at: float, origin: str = "prolog") -> NodeEvent:
    return NodeEvent("plain", node, iso(at), "Unknown", "DRAIN",
                     f"gpuwarden: {origin}: xid 79 on GPU 0 [health]", "root")


@dataclass
class Young:
    """A SlurmClient over a cluster that registered ``age_h`` hours ago."""

    age_h: float
    jobs: list[AcctJob] = field(default_factory=list)
    events_: list[NodeEvent] = field(default_factory=list)

    def events(self, start: str, end: str) -> list[NodeEvent]:
        return list(self.events_)

    def acct_jobs(self, start: str, end: str) -> Iterator[AcctJob]:
        return iter(self.jobs)

    def nodes(self) -> list[Node]:
        return [Node(n, ("IDLE",), "", "", None, ("gpu",), "gpu:h100:8", (), None)
                for n in ("c1", "c2", "c3")]


def first_day(drain_with_failure: bool = False) -> Young:
    """Registered 4 h ago; 8-GPU runs on c1-c3; three prolog drains that interrupted no run
    (the prolog refused the job before it started: Slurm requeued it held, no run to fail),
    or, with ``drain_with_failure``, c1's drain came within seconds of a run failing on it."""
    now = time.time()
    born = now - 4 * H
    jobs = [run(i, "COMPLETED", f"c{1 + i % 3}", born + 600 + i * 60, 1800) for i in range(6)]
    events = [registered(born)]
    events += [health_drain(f"c{i}", born + 3 * H + i * 60) for i in (1, 2, 3)]
    if drain_with_failure:
        jobs.append(run(99, "FAILED", "c1", born + 3 * H - 1200, 1200 - 30))
        events[1] = health_drain("c1", born + 3 * H, "epilog")
    return Young(4, jobs, events)


@pytest.fixture(autouse=True)
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    p = tmp_path / "gpuwarden.toml"
    p.write_text("")
    monkeypatch.setenv("GPUWARDEN_CONFIG", str(p))
    return p


def invoke(client: Young, *args: str) -> str:
    ctx = Context(client_factory=lambda cfg: client)  # type: ignore[arg-type,return-value]
    res = CliRunner().invoke(cli, list(args), obj=ctx)
    assert res.exit_code == 0, res.output
    return res.stdout


def mttf_json(client: Young) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(invoke(client, "fleet", "mttf", "--json"))
    return doc


def test_fleet_mttf_reads_a_young_cluster_from_its_registration_not_30_days() -> None:
    doc = mttf_json(first_day())
    # 3 nodes x 4 h, not 3 nodes x 30 days = 90 node-days.
    assert doc["node_days"] == pytest.approx(0.5, rel=1e-3)
    assert doc["span_days"] == pytest.approx(4 / 24, rel=1e-3)
    text = invoke(first_day(), "fleet", "mttf")
    assert "90.0 node-days" not in text and "30.0 days of history" not in text
    assert "0.5 node-days" in text
    # The window read is said, and why it is shorter than asked.
    assert "history read:" in text and "(4.0 h" in text
    assert "the cluster's registration" in text and "asked for 30.0 days" in text


def test_fleet_mttf_says_which_drains_count_as_failures_and_why_the_others_do_not() -> None:
    text = invoke(first_day(), "fleet", "mttf")
    # The old output: "3 health-gating drains" beside "no infrastructure failure": both true
    # only once it says the drains are node failures that interrupted no run.
    assert "no infrastructure failure" not in text
    assert ("3 health-gating drains: 3 counted as node failures (r_f); counted as job "
            "failures: 0; not counted as job failures: 3, no run failed with them (they "
            "interrupted no job)") in text
    doc = mttf_json(first_day())
    assert doc["node_failures"] == 3
    assert (doc["drains_with_failed_run"], doc["drains_without_gpus"],
            doc["drains_no_failed_run"]) == (0, 0, 3)
    assert doc["failures"] == 0


def test_a_drain_that_came_with_a_failed_run_is_that_runs_failure_counted_once() -> None:
    doc = mttf_json(first_day(drain_with_failure=True))
    assert doc["failures"] == 1 and doc["node_failures"] == 3
    assert (doc["drains_with_failed_run"], doc["drains_no_failed_run"]) == (1, 2)
    text = invoke(first_day(drain_with_failure=True), "fleet", "mttf")
    assert "counted as job failures: 1 (the failed run it came with" in text
    assert "1 job failure(s) blamed on the infrastructure in 4.0 h of history" in text


def test_a_drain_whose_failed_run_has_no_gpus_in_accounting_says_so() -> None:
    young = first_day(drain_with_failure=True)
    young.jobs = [AcctJob(**{**j.__dict__, "gpus": 0}) for j in young.jobs]
    doc = mttf_json(young)
    assert doc["failures"] == 0
    assert (doc["drains_with_failed_run"], doc["drains_without_gpus"]) == (0, 1)
    text = invoke(young, "fleet", "mttf")
    assert "AccountingStorageTRES=gres/gpu" in text


def test_the_report_shows_the_same_window_and_counts_as_fleet_mttf(tmp_path: Path) -> None:
    for young in (first_day(), first_day(drain_with_failure=True)):
        mt = mttf_json(young)
        out = tmp_path / "r.json"
        invoke(young, "report", "-o", str(tmp_path / "r.html"), "--json", str(out))
        rep = json.loads(out.read_text())
        m = rep["mttf"]
        assert m["node_days"] == round(mt["node_days"], 1)
        assert rep["span_days"] == round(mt["span_days"], 1)
        assert m["failures"] == mt["failures"] and m["node_failures"] == mt["node_failures"]
        assert m["insufficient"] == mt["insufficient"]
        assert m["drains_note"] == mt["drains_note"]
        # The two commands ran a moment apart: the same note but for "now".
        assert _sans_now(rep["window_note"]) == _sans_now(mt["window_note"])
        page = " ".join((tmp_path / "r.html").read_text().split())
        assert mt["drains_note"] in page.replace("&#39;", "'")
        assert rep["first"] == iso(_born(young)) + "Z"


def _sans_now(note: str) -> str:
    """The note with the times that follow the clock (the end read, the start asked) out."""
    return re.sub(r" to \S+Z| from \S+Z", "", note)


def _born(young: Young) -> float:
    return datetime.fromisoformat(young.events_[0].start).replace(tzinfo=UTC).timestamp()


def test_exported_files_are_bounded_by_the_first_thing_recorded_too(tmp_path: Path) -> None:
    # An export asked for 30 days (its meta names --starttime 30 days back); the events file
    # shows the cluster registering 4 h ago: node-days are 4 h's.
    young = first_day()
    now = time.time()
    from tests.unit.test_lemon_core import sacct_export

    doc = json.loads(sacct_export(young.jobs))
    doc["jobs"] = [j for j in doc["jobs"] if "job_id" in j]
    for j, src in zip(doc["jobs"], young.jobs, strict=True):
        j["tres"] = {"allocated": [{"type": "gres", "name": "gpu", "count": src.gpus}]}
    doc["meta"] = {"command": ["sacct", f"--starttime={iso(now - 30 * 86_400)}",
                               f"--endtime={iso(now)}", "--json"]}
    export = tmp_path / "sacct.json"
    export.write_text(json.dumps(doc))
    events = tmp_path / "events.txt"
    events.write_text("\n".join(f"{e.cluster}|{e.node}|{e.start}|{e.end}|{e.state}|{e.reason}|"
                                f"{e.user}" for e in young.events_))
    got = json.loads(CliRunner().invoke(cli, ["fleet", "mttf", "--from", str(export),
                                              "--events", str(events), "--json"],
                                        obj=Context()).stdout)
    assert got["node_days"] == pytest.approx(0.5, rel=1e-2)
    assert got["node_failures"] == 3


def test_without_events_the_first_run_bounds_the_window(tmp_path: Path) -> None:
    # No events at all: the first run recorded is the earliest the cluster is known to exist.
    now = time.time()
    jobs = [run(1, "COMPLETED", "c1", now - 2 * H, 600), run(2, "COMPLETED", "c2", now - H, 600)]
    young = Young(2, jobs, [])
    doc = mttf_json(young)
    assert doc["span_days"] == pytest.approx(2 / 24, rel=1e-2)
    assert "the first run" in doc["window_note"]


def test_an_old_cluster_is_read_for_the_whole_window_asked() -> None:
    # Registered long before --since: the window asked is the window read.
    young = first_day()
    young.events_[0] = registered(time.time() - 400 * 86_400)
    doc = json.loads(invoke(young, "fleet", "mttf", "--since", "2d", "--json"))
    assert doc["span_days"] == pytest.approx(2.0, rel=1e-3)
    assert doc["window_note"].startswith("history read: ") and "asked for" not in doc["window_note"]


def test_history_bounds_its_windows_below_by_the_first_thing_seen() -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    young = first_day()
    from datetime import timedelta
    h = history.from_cluster(young, timedelta(days=30), now=now)  # type: ignore[arg-type]
    assert h.window is not None and h.window[0] == pytest.approx(_born(young))
    assert h.asked is not None and h.asked[0] == pytest.approx(now.timestamp() - 30 * 86_400)


def test_the_report_counts_the_days_read_as_fleet_mttf_does_not_a_gap(tmp_path: Path) -> None:
    # Days 0 and 2 exported, day 1 missing: both say 2 days read (the page said 3 before).
    from tests.unit.test_lemon_core import sacct_export

    t0 = 1_767_225_600  # 2026-01-01T00:00:00Z
    day = 86_400
    paths = []
    for d in (0, 2):
        doc = json.loads(sacct_export([run(d, "COMPLETED", "c1", t0 + d * day + 600, 600)]))
        doc["jobs"] = [j for j in doc["jobs"] if "job_id" in j]
        doc["meta"] = {"command": ["sacct", f"--starttime={iso(t0 + d * day)}",
                                   f"--endtime={iso(t0 + (d + 1) * day)}", "--json"]}
        paths += ["--from", str(tmp_path / f"d{d}.json")]
        (tmp_path / f"d{d}.json").write_text(json.dumps(doc))
    events = tmp_path / "events.txt"
    events.write_text(f"plain||{iso(t0 - day)}|Unknown||Cluster Registered TRES|\n")
    common = [*paths, "--events", str(events)]
    mt = json.loads(CliRunner().invoke(cli, ["fleet", "mttf", *common, "--json"],
                                       obj=Context()).stdout)
    res = CliRunner().invoke(cli, ["report", *common, "-o", str(tmp_path / "r.html"),
                                   "--json", str(tmp_path / "r.json")], obj=Context())
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert mt["span_days"] == rep["span_days"] == 2.0
    assert rep["window_note"] == mt["window_note"]
    assert "(2.0 days read; 24.0 h missing between exports)" in mt["window_note"]


def test_ckpt_interval_names_the_window_read_not_the_since_asked(tmp_path: Path) -> None:
    # `ckpt interval` reads the same history: with no failure and no [ckpt] mttf_h it said
    # "no failures of 8-GPU jobs in the accounting history since 30d".
    ctx = Context(client_factory=lambda c: first_day())  # type: ignore[arg-type,return-value]
    res = CliRunner().invoke(cli, ["ckpt", "interval", "--gpus", "8", "--cost", "30s"], obj=ctx)
    assert res.exit_code == 1, res.output
    assert "since 30d" not in res.output
    assert "(4.0 h)" in res.output and "the cluster's registration" in res.output
