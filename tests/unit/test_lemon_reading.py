"""Issue 13 items 3-4: accounting read as a stream, windows split on timeouts, and what an
operator sees (progress, an empty scan, the lemon list after a resume, MTTF on little data)."""

from __future__ import annotations

import io
import json
import logging
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.accounting import history, mttf
from gpuwarden.accounting import lemonlist as listfile
from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting.attribution import attribute
from gpuwarden.accounting.options import progress
from gpuwarden.cli import cli
from gpuwarden.config import Config
from gpuwarden.config.context import Context
from gpuwarden.core.errors import SlurmParseError
from gpuwarden.placement.snapshot import suspects
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import AcctJob, NodeEvent
from gpuwarden.slurm.runner import CommandTimeoutError
from tests.fakes import FakeSlurm
from tests.unit.test_lemon_core import T0, fleet_history, job, sacct_export
from tests.unit.test_lemon_drain import node

FIXTURE = Path(__file__).parent.parent / "fixtures" / "sacct.json"


def streamed(text: str, chunk: int) -> list[AcctJob | object]:
    data = io.BytesIO(text.encode())
    return list(acctstream.AcctStream(acctstream.text_reader(data), "t"))


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_streaming_yields_the_same_records_as_a_whole_decode(monkeypatch, chunk) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(acctstream, "CHUNK", chunk)
    text = FIXTURE.read_text()
    whole = [r for r in parse.iter_acct_jobs(text)]
    assert streamed(text, chunk) == whole
    odd = '{"meta": {"x": 1}, "jobs": [{"job_id": 5, "nodes": "c1", "state": {"current": ' \
          '["FAILED"]}}, 12, {"name": "no id"}], "errors": []}'
    out = streamed(odd, chunk)
    assert isinstance(out[0], AcctJob) and out[0].job_id == 5
    assert all(isinstance(r, SlurmParseError) for r in out[1:])


def test_a_broken_or_erroring_document_is_an_error_not_a_short_history() -> None:
    with pytest.raises(SlurmParseError, match="not JSON"):
        streamed('{"jobs": [{"job_id": 1}, {"job_', 4096)
    with pytest.raises(SlurmParseError, match="Slurm reported an error: boom"):
        streamed('{"jobs": [], "errors": [{"description": "boom"}]}', 4096)
    with pytest.raises(SlurmParseError, match="no 'jobs' list"):
        streamed('{"meta": {}}', 4096)


def test_an_export_whose_meta_follows_the_jobs_keeps_its_window(tmp_path: Path,
                                                                  monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Slurm writes "meta" last; the window must hold even when it is not in the tail read."""
    monkeypatch.setattr(acctstream, "TAIL", 64)
    day = datetime.fromtimestamp(T0, UTC).replace(tzinfo=None)
    inside = job(1, "NODE_FAIL", "c1", start=T0 + 60)
    before = job(2, "NODE_FAIL", "c2", start=T0 - 7200)  # ended before the window began
    doc = json.loads(sacct_export([inside, before]))
    doc["jobs"] = doc["jobs"][:-1]
    doc["meta"] = {"command": ["sacct", f"--starttime={day.isoformat()}",
                               f"--endtime={(day + timedelta(days=1)).isoformat()}"],
                   "pad": "x" * 200}
    path = tmp_path / "day.json"
    path.write_text(json.dumps(doc))
    h = history.from_files([str(path)], [])
    assert [b.node for b in h.attribution.blames] == ["c1"]


class Reader:
    """sacct that cannot answer for more than ``limit`` of accounting before its deadline."""

    def __init__(self, jobs: list[AcctJob], limit: timedelta) -> None:
        self.jobs, self.limit, self.calls = jobs, limit, []  # type: ignore[var-annotated]

    def window(self, start: str, end: str):  # type: ignore[no-untyped-def]
        self.calls.append((start, end))
        lo, hi = (datetime.fromisoformat(t).replace(tzinfo=UTC) for t in (start, end))
        yield from self.jobs[:1]  # some records arrive before the deadline passes
        if hi - lo > self.limit:
            raise CommandTimeoutError(["sacct"], 30)
        yield from self.jobs[1:]


class Events:
    def events(self, start: str, end: str) -> list[object]:
        return []


def test_a_window_that_times_out_is_split_and_counted_once(caplog) -> None:  # type: ignore[no-untyped-def]
    now = datetime.fromtimestamp(T0 + 86_400, UTC)
    jobs = [job(1, "NODE_FAIL", "c1", start=T0 + 600), job(2, "COMPLETED", "c2", start=T0 + 900)]
    r = Reader(jobs, timedelta(hours=6))
    with caplog.at_level(logging.WARNING):
        h = history.from_cluster(Events(), timedelta(days=1), now=now, reader=r)  # type: ignore[arg-type]
    assert h.attribution.exposure["c1"].jobs == 1 and len(h.attribution.blames) == 1
    assert h.attribution.exposure["c2"].jobs == 1
    assert "two halves" in caplog.text
    assert len(r.calls) == 1 + 2 + 4  # 24 h, 2 x 12 h, 4 x 6 h
    with pytest.raises(history.HistoryError, match="command_timeout_s"):
        history.from_cluster(Events(), timedelta(days=1), now=now,  # type: ignore[arg-type]
                             reader=Reader(jobs, timedelta(minutes=1)))


def test_progress_counts_real_days_and_stays_quiet_off_a_terminal(capsys) -> None:  # type: ignore[no-untyped-def]
    now = datetime.fromtimestamp(T0 + 86_400, UTC)
    seen: list[tuple[int, int]] = []
    history.from_cluster(Events(), timedelta(days=1), now=now,  # type: ignore[arg-type]
                         progress=lambda d, t: seen.append((d, t)),
                         reader=Reader([], timedelta(days=2)))
    assert seen == [(1, 1)]
    t = [0.0]
    show = progress("reading accounting, day", tty=False, clock=lambda: t[0])
    for d in range(1, 31):
        show(d, 30)
    assert capsys.readouterr().err == ""  # a quick read: nothing in the log
    t[0] = 45.0
    show(12, 30)
    err = capsys.readouterr().err
    assert err == "reading accounting, day 12/30\n"  # a plain line, no carriage return


def test_scan_without_lemons_says_so(tmp_path: Path) -> None:
    export = tmp_path / "sacct.json"
    export.write_text(sacct_export(fleet_history(set(), seed=4)))
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export)], obj=Context())
    assert res.exit_code == 0, res.output
    assert "no lemons among 64 nodes (4001 jobs)" in res.stdout


def test_scan_explains_each_node_and_labels_the_expected_column(tmp_path: Path) -> None:
    export = tmp_path / "sacct.json"
    export.write_text(sacct_export(fleet_history({"n7"}, seed=3)))
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export)], obj=Context())
    assert res.exit_code == 0, res.output
    assert "FLEET x H" in res.stdout and "ATTRIB" in res.stdout
    assert "node-hours" in res.stdout and "why: " in res.stdout
    doc = json.loads(CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export),
                                              "--json"], obj=Context()).stdout)
    [n7] = [n for n in doc["nodes"] if n["node"] == "n7"]
    assert n7["explanation"] and n7["attributed"] > 0


def test_lemon_list_follows_a_resumed_lemon(tmp_path: Path) -> None:
    lst = tmp_path / "lemons.json"
    listfile.write(str(lst), [listfile.LemonEntry("n7", "lemon, 9 of 40 jobs failed", 9, 40,
                                                  1e-6, "drained")])
    slurm = FakeSlurm({"n7": node("n7")})  # an operator resumed it after repair
    ctx = Context(client_factory=lambda _: slurm)  # type: ignore[arg-type,return-value]
    ctx._config = replace(Config(), lemon=replace(Config().lemon, list_file=str(lst)))
    out = CliRunner().invoke(cli, ["lemon", "list"], obj=ctx)
    assert out.exit_code == 0, out.output
    assert "[drained]" not in out.stdout and "since resumed" in out.stdout
    doc = json.loads(CliRunner().invoke(cli, ["lemon", "list", "--json"], obj=ctx).stdout)
    assert doc["nodes"][0]["state"] == "in service"
    # ... and the placement filter no longer keeps jobs off it.
    assert suspects([slurm.table["n7"]], {"n7": "drained"}) == {}


def test_mttf_on_little_history_says_the_data_is_insufficient() -> None:
    jobs = [replace(job(1, "NODE_FAIL", "c1", hours=1.0), gpus=8),
            replace(job(2, "COMPLETED", "c2", start=T0 + 3600, hours=1.0), gpus=8)]
    rep = mttf.report(attribute(jobs), [], 8, 30.0, (16_384,))
    assert rep.projections[0].from_history_h is None  # not "0.0 min"
    assert "insufficient data" in rep.insufficient and "about" in rep.insufficient
    # 1 failure in 2 h of history: 10 need about 20 h (said in hours, not "0.1 days").
    assert "in 2.0 h of history" in rep.insufficient and "about 20.0 h" in rep.insufficient


def _day_file(tmp: Path, name: str, jobs: list[AcctJob], command: list[str]) -> str:
    doc = json.loads(sacct_export(jobs))
    doc["jobs"] = doc["jobs"][:-1]
    doc["meta"] = {"command": command}
    path = tmp / name
    path.write_text(json.dumps(doc))
    return str(path)


def _iso(t: int) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def test_day_files_whose_command_lost_its_end_count_a_run_that_crossed_midnight_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # `sacct --json ... --starttime=$s --endtime=$e`: before 26.05.2 meta.command loses its
    # last argument, so each day names its start only. A run that failed across midnight is
    # in both days' exports.
    day = 86_400
    crossing = job(1, "NODE_FAIL", "c1", start=T0 + day - 3600)  # ends an hour into day 2
    first = job(2, "COMPLETED", "c2", start=T0 + 60)
    second = job(3, "COMPLETED", "c3", start=T0 + day + 7200)
    paths = [_day_file(tmp_path, f"d{i}.json", jobs,
                       ["sacct", "--json", "--allusers", f"--starttime={_iso(T0 + i * day)}"])
             for i, jobs in enumerate([[first, crossing], [crossing, second]])]
    with caplog.at_level(logging.WARNING):
        h = history.from_files(paths, [])
    assert h.attribution.exposure["c1"].jobs == 1
    assert [b.node for b in h.attribution.blames] == ["c1"]
    assert "names no end" in caplog.text and "put --json last" in caplog.text


@pytest.mark.parametrize("second", [(1, 3), (0, 2)])  # overlapping days; a copy of the first
def test_exports_whose_windows_overlap_are_refused_naming_both(tmp_path: Path,
                                                              second: tuple[int, int]) -> None:
    day = 86_400
    jobs = [job(1, "NODE_FAIL", "c1", start=T0 + day + 60)]
    paths = [_day_file(tmp_path, f"w{i}.json", jobs,
                       ["sacct", "--json", f"--starttime={_iso(T0 + a * day)}",
                        f"--endtime={_iso(T0 + b * day)}", "--allusers"])
             for i, (a, b) in enumerate([(0, 2), second])]
    with pytest.raises(history.HistoryError, match=r"w0.json .* and .*w1.json .* overlap: "
                                                   r"the runs that ended in both would count "
                                                   r"twice"):
        history.from_files(paths, [])


def test_node_days_are_the_exports_window_not_stretched_by_a_run_that_started_before_it(
        tmp_path: Path) -> None:
    # One day of accounting; one run started six days before it. The failures were looked for
    # in that day only: node-days are one day's, and the page's span is the day.
    day = 86_400
    old = replace(job(1, "COMPLETED", "c1", start=T0 - 6 * day), end_time=T0 + 3600)
    jobs = [old] + [job(i, "COMPLETED", f"c{i}", start=T0 + 600) for i in range(2, 5)]
    jobs = [replace(j, gpus=8) for j in jobs]
    path = _day_file(tmp_path, "d.json", jobs,
                     ["sacct", f"--starttime={_iso(T0)}", f"--endtime={_iso(T0 + day)}",
                      "--json"])
    h = history.from_files([path], [])
    assert h.window == (T0, T0 + day)
    rep = mttf.report(h.attribution, h.events, 8, 30.0, (16_384,), windows=h.windows)
    assert rep.span_days == 1.0 and rep.node_days == 4.0


def test_another_clusters_node_events_never_blame_this_clusters_runs(tmp_path: Path) -> None:
    # `sacctmgr show events` of every cluster in the database: cluster "b" has a node c1 too,
    # and its health drain at the time this cluster's c1 run failed must not blame it.
    run = replace(job(1, "FAILED", "c1", start=T0 + 60), gpus=8)
    at = datetime.fromtimestamp(run.end_time or 0, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    drain = NodeEvent("b", "c1", at, "Unknown", "DRAIN", "gpuwarden: xid 79 [health]", "root")
    ours = NodeEvent("a", "c9", at, "Unknown", "DRAIN", "maintenance", "root")
    doc = json.loads(sacct_export([run]))
    doc["jobs"] = doc["jobs"][:-1]
    doc["meta"] = {"command": ["sacct"], "slurm": {"cluster": "a"}}
    path = tmp_path / "a.json"
    path.write_text(json.dumps(doc))
    h = history.from_files([str(path)], [drain, ours])
    assert h.attribution.blames == [] and h.events == (ours,)
    # Without the accounting's cluster, events of several clusters are refused.
    del doc["meta"]["slurm"]
    path.write_text(json.dumps(doc))
    with pytest.raises(history.HistoryError, match=r"several clusters \(a, b\).*cluster=NAME"):
        history.from_files([str(path)], [drain, ours])


def test_an_export_saved_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    text = sacct_export([job(1, "NODE_FAIL", "c1", start=T0 + 60)])
    plain, marked = tmp_path / "plain.json", tmp_path / "bom.json"
    plain.write_text(text)
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode())
    got = [history.from_files([str(p)], []).attribution.blames for p in (plain, marked)]
    assert got[0] == got[1] and len(got[0]) == 1


def test_node_days_cover_only_the_days_read(tmp_path: Path) -> None:
    # Days 0 and 2 exported, day 1 missing: node-days are two days' (not three), and a health
    # drain on day 1, never read, is no failure and no lone blame.
    day = 86_400
    runs = {d: [replace(job(10 * d + i, "COMPLETED", f"c{i}", start=T0 + d * day + 600),
                        gpus=8) for i in (1, 2)] for d in (0, 2)}
    paths = [_day_file(tmp_path, f"d{d}.json", runs[d],
                       ["sacct", f"--starttime={_iso(T0 + d * day)}",
                        f"--endtime={_iso(T0 + (d + 1) * day)}", "--json"]) for d in (0, 2)]
    drain = NodeEvent("g", "c9", _iso(T0 + day + 6 * 3600), "Unknown", "DRAIN",
                      "gpuwarden: periodic: xid 79 [health]", "root")
    # The cluster registered before the first day (else its first run bounds the read).
    h = history.from_files(paths, [_registered(T0 - day), drain])
    assert h.windows == ((T0, T0 + day), (T0 + 2 * day, T0 + 3 * day))
    rep = mttf.report(h.attribution, h.events, 8, 30.0, (16_384,), windows=h.windows)
    assert (rep.span_days, rep.node_failures) == (2.0, 0)
    assert not [b for b in h.attribution.blames if b.node == "c9"]


def test_the_newest_exports_lost_end_is_its_last_run(tmp_path: Path) -> None:
    run = replace(job(1, "COMPLETED", "c1", start=T0 + 600), gpus=8)
    path = _day_file(tmp_path, "d.json", [run], ["sacct", f"--starttime={_iso(T0)}", "--json"])
    assert history.from_files([path], [_registered(T0 - 60)]).windows == ((T0, run.end_time),)
    # Without a node event, the first run is the first thing recorded: the read starts there.
    assert history.from_files([path], []).windows == ((run.start_time, run.end_time),)


def _registered(at: int) -> NodeEvent:
    """slurmctld's own event when the cluster registers (no node): `sacctmgr show events`."""
    return NodeEvent("g", "", _iso(at), "Unknown", "", "Cluster Registered TRES", "")


def test_node_events_all_of_another_cluster_are_refused(tmp_path: Path) -> None:
    run = replace(job(1, "FAILED", "c1", start=T0 + 60), gpus=8)
    doc = json.loads(sacct_export([run]))
    doc["jobs"] = doc["jobs"][:-1]
    doc["meta"] = {"command": ["sacct"], "slurm": {"cluster": "a"}}
    path = tmp_path / "a.json"
    path.write_text(json.dumps(doc))
    theirs = NodeEvent("b", "c1", _iso(T0 + 60), "Unknown", "DRAIN", "gpuwarden: x [health]",
                       "root")
    with pytest.raises(history.HistoryError, match="cluster b and the accounting of a"):
        history.from_files([str(path)], [theirs])


@pytest.mark.parametrize("windowed", [True, False])
def test_an_export_without_a_window_whose_runs_meet_another_export_is_warned_of(
        tmp_path: Path, windowed: bool, caplog: pytest.LogCaptureFixture) -> None:
    # A plain `sacct --json -S now-2days` beside the day files of the same days: every run
    # that ended in a day file's window is in both, and counts twice. Before, unsaid. (Not
    # refused: exports split by partition or user meet the same way and are right.)
    day = 86_400
    failed = job(1, "NODE_FAIL", "c1", start=T0 + 60)
    later = job(2, "COMPLETED", "c2", start=T0 + 3 * day)
    other = ["sacct", "--json", f"--starttime={_iso(T0)}", f"--endtime={_iso(T0 + day)}",
             "--allusers"] if windowed else ["sacct", "--json", "-S", "now-9days"]
    paths = [_day_file(tmp_path, "day.json", [failed], other),
             _day_file(tmp_path, "recent.json", [failed, later],
                       ["sacct", "--json", "-S", "now-2days"])]
    with caplog.at_level(logging.WARNING):
        history.from_files(paths, [])
    assert "recent.json: names no window" in caplog.text
    assert re.search(r"json names no window and lists runs that ended .* which meets .*json "
                     r".*counts twice", caplog.text)
    # Its runs after the other's: nothing meets.
    paths[1] = _day_file(tmp_path, "recent.json", [later],
                         ["sacct", "--json", "-S", "now-2days"])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        h = history.from_files(paths, [])
    assert h.records == 2 and "meets" not in caplog.text


def test_a_lone_export_without_a_window_is_read_whole_and_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _day_file(tmp_path, "all.json", [job(1, "COMPLETED", "c1")], ["sacct", "--json"])
    with caplog.at_level(logging.INFO):
        h = history.from_files([path], [])
    assert h.records == 1 and "all.json: names no window" in caplog.text


def _meta_early(tmp: Path, name: str, jobs: list[AcctJob], command: list[str]) -> str:
    """An export whose "meta" is not in the tail the planner reads (warnings after it)."""
    doc = json.loads(sacct_export(jobs))
    path = tmp / name
    path.write_text(json.dumps({"meta": {"command": command}, "jobs": doc["jobs"][:-1],
                                "warnings": ["x" * 300]}))
    return str(path)


def test_an_export_whose_meta_is_found_only_when_read_is_planned_with_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Its window was used for its own runs but was not said, checked nor planned: it was
    # called window-less (a false warning), an end it lost was not the next export's start
    # (a run across midnight counted twice), and an overlap was not refused.
    monkeypatch.setattr(acctstream, "TAIL", 64)
    day = 86_400
    crossing = job(1, "NODE_FAIL", "c1", start=T0 + day - 3600)
    first = _meta_early(tmp_path, "d0.json", [crossing],
                        ["sacct", "--json", f"--starttime={_iso(T0)}"])  # its end lost
    second = _day_file(tmp_path, "d1.json", [crossing],
                       ["sacct", "--json", f"--starttime={_iso(T0 + day)}",
                        f"--endtime={_iso(T0 + 2 * day)}"])
    with caplog.at_level(logging.WARNING):
        h = history.from_files([first, second], [], workers=1)
    assert "names no window" not in caplog.text
    assert h.attribution.exposure["c1"].jobs == 1
    assert [b.node for b in h.attribution.blames] == ["c1"]
    again = _meta_early(tmp_path, "again.json", [crossing],
                        ["sacct", "--json", f"--starttime={_iso(T0 + day)}",
                         f"--endtime={_iso(T0 + 2 * day)}"])
    with pytest.raises(history.HistoryError, match="overlap"):
        history.from_files([again, second], [], workers=1)


def test_a_windowed_export_none_of_whose_runs_could_be_listed_twice_is_not_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A run in both exports ends in both exports' run-end spans; the day file's window alone
    # is wider than what it listed.
    day = ["sacct", "--json", f"--starttime={_iso(T0)}", f"--endtime={_iso(T0 + 86_400)}"]
    recent = ["sacct", "--json", "-S", "now-2days"]
    late = job(2, "COMPLETED", "c2", start=T0 + 20 * 3600)
    for listed in ([job(1, "COMPLETED", "c1", start=T0)], []):
        paths = [_day_file(tmp_path, "day.json", listed, day),
                 _day_file(tmp_path, "recent.json", [late], recent)]
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            history.from_files(paths, [], workers=1)
        assert "counts twice" not in caplog.text


def test_times_no_calendar_holds_are_said_as_numbers_not_a_crash(tmp_path: Path) -> None:
    bad = [job(i, "COMPLETED", f"c{i}", start=-10**15) for i in (1, 2)]
    paths = [_day_file(tmp_path, f"{i}.json", [j], ["sacct", "--json"])
             for i, j in enumerate(bad)]
    assert history.from_files(paths, [], workers=1).records == 2


@pytest.mark.parametrize(("theirs", "warned"), [
    ((T0 + 100.0, T0 + 200.0), True),   # the same second ends both: a run may be in both
    ((T0 + 101.0, T0 + 200.0), False),  # a second apart
    (None, False),                       # it listed no run
])
def test_window_less_spans_warn_only_where_a_run_could_be_in_both(
        theirs: tuple[float, float] | None, warned: bool) -> None:
    from gpuwarden.accounting.windows import check_ends

    mine = (T0 + 0.0, T0 + 100.0)
    for other in ((None, None), (T0 - 86_400.0, T0 + 86_400.0)):
        got = check_ends(["a", "b"], [(None, None), other], [mine, theirs])
        assert bool(got) is warned, (other, got)
        if other == (None, None):  # two window-less exports: said once, in either order
            assert len(got) == len(check_ends(["b", "a"], [other, other], [theirs, mine])) \
                == int(warned)


def test_a_late_meta_between_day_files_that_lost_their_ends_reads_each_run_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Planned first without the middle file's start, the first file's lost end was the third
    # file's start; planning again from those filled-in windows refused a valid history.
    monkeypatch.setattr(acctstream, "TAIL", 200)  # the day files' meta in it, not d1's
    day = 86_400
    crossing = job(1, "NODE_FAIL", "c1", start=T0 + day - 3600)  # ends an hour into day 2
    late = job(2, "NODE_FAIL", "c2", start=T0 + 2 * day - 3600)  # ends an hour into day 3
    lists = [[crossing], [crossing, late], [late]]
    paths = [(_meta_early if i == 1 else _day_file)(
        tmp_path, f"d{i}.json", jobs, ["sacct", "--json", f"--starttime={_iso(T0 + i * day)}"])
        for i, jobs in enumerate(lists)]
    for workers in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            h = history.from_files(paths, [], workers=workers)
        assert {n: e.jobs for n, e in h.attribution.exposure.items() if e.jobs} == \
            {"c1": 1, "c2": 1}
        assert sorted(b.node for b in h.attribution.blames) == ["c1", "c2"]
        # Each lost end said once, as the end the final plan used.
        assert caplog.text.count("d0.json: its window names no end") == 1
        assert re.search(r"d0\.json: its window names no end.* next export's start, "
                         + _iso(T0 + day), caplog.text)


def test_every_pair_of_window_less_exports_that_meet_is_warned_of() -> None:
    from gpuwarden.accounting.windows import check_ends

    t, day = float(T0), 86_400.0
    got = check_ends(["w", "x", "v"], [(None, None), (t - day, t + day), (None, None)],
                     [(t, t + 7200), (t + 3600, t + 3600), (t + 5000, t + 6000)])
    assert len(got) == 2 and "meets x" in got[0] and "meets v" in got[1]
