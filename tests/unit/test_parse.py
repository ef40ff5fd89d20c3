"""Parsers, tested on JSON captured from the real 24.11 test cluster (tests/fixtures/)."""

from collections.abc import Callable

import pytest

from gpuwarden.core.errors import SlurmParseError
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import AcctJob

Read = Callable[[str], str]


def test_nodes_from_scontrol(fixture_text: Read) -> None:
    nodes = {n.name: n for n in parse.parse_nodes(fixture_text("scontrol_show_nodes.json"))}
    assert sorted(nodes) == [f"c{i}" for i in range(1, 9)]
    c4, c7, c1 = nodes["c4"], nodes["c7"], nodes["c1"]
    assert c4.drained and c4.reason == "maintenance" and c4.owner == "root"
    assert not c4.reason_is_ours
    assert c7.drained and c7.reason_is_ours and c7.owner == "gpuwarden"
    assert c7.reason == "gpuwarden: xid 79 on GPU 5"
    assert c1.state == ("IDLE",) and not c1.drained and c1.owner == ""
    assert c1.gres == "gpu:h100:8" and c1.partitions == ("gpu",)
    assert c4.reason_changed_at and c4.reason_changed_at > 1_700_000_000


def test_sinfo_partitions(fixture_text: Read) -> None:
    parts = parse.parse_sinfo_partitions(fixture_text("sinfo.json"))
    assert list(parts) == ["gpu"]
    assert sorted(parts["gpu"]) == [f"c{i}" for i in range(1, 9)]


def test_jobs_from_scontrol(fixture_text: Read) -> None:
    jobs = {j.job_id: j for j in parse.parse_jobs(fixture_text("scontrol_show_job.json"))}
    assert jobs[1].state == ("COMPLETED",) and jobs[1].nodes == "c[1-2]" and jobs[1].num_nodes == 2
    assert jobs[3].state == ("FAILED",) and jobs[3].exit_code == 3
    assert jobs[4].state == ("CANCELLED",) and jobs[4].exit_code is None
    assert jobs[6].state == ("PENDING",) and jobs[6].state_reason == "Resources"
    assert jobs[2].user == "alice" and jobs[1].user == "root"


def test_sacct_records(fixture_text: Read) -> None:
    recs = [r for r in parse.iter_acct_jobs(fixture_text("sacct.json"))]
    assert all(isinstance(r, AcctJob) for r in recs)
    by_id = {r.job_id: r for r in recs if isinstance(r, AcctJob)}
    assert by_id[1].state == "COMPLETED" and by_id[1].gpus == 16 and by_id[1].num_nodes == 2
    assert by_id[3].state == "FAILED" and by_id[3].exit_code == 3
    assert by_id[4].state == "CANCELLED"
    assert by_id[5].state == "TIMEOUT"
    node_fail = [r for r in recs if isinstance(r, AcctJob) and r.job_id == 7]
    assert node_fail[0].state == "NODE_FAIL" and node_fail[0].nodes == "c8"
    assert by_id[1].start_time and by_id[1].end_time and by_id[1].end_time >= by_id[1].start_time


def test_malformed_sacct_record_is_reported_not_fatal() -> None:
    text = '{"jobs": [{"job_id": 7, "state": {"current": ["FAILED"]}}, {"name": "no id"}]}'
    recs = list(parse.iter_acct_jobs(text))
    assert isinstance(recs[0], AcctJob) and recs[0].state == "FAILED"
    assert isinstance(recs[1], SlurmParseError) and "job_id" in str(recs[1])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ("{}", "no 'nodes' list"),
        ('{"nodes": [], "errors": [{"description": "Invalid node name"}]}', "Invalid node name"),
    ],
)
def test_bad_node_output_gets_a_clear_error(text: str, match: str) -> None:
    with pytest.raises(SlurmParseError, match=match):
        parse.parse_nodes(text)


def test_events(fixture_text: Read) -> None:
    events = parse.parse_events(fixture_text("sacctmgr_show_events.txt"))
    reasons = {(e.node, e.reason) for e in events}
    assert ("c4", "maintenance") in reasons
    assert ("c7", "gpuwarden: xid 79 on GPU 5") in reasons
    assert all(e.cluster == "gpuwarden" for e in events)
    assert ("c8", "DOWN*", "Not responding") in {(e.node, e.state, e.reason) for e in events}
    assert {e.user for e in events if e.node} == {"root"}


def test_events_printed_with_p_or_with_the_header_read_the_same(fixture_text: Read) -> None:
    # `sacctmgr -p` ends every line with "|": read as -P, the user stayed in the reason and a
    # health drain's "[health]" tag was lost (its drains counted as an operator's).
    text = fixture_text("sacctmgr_show_events.txt")
    want = parse.parse_events(text)
    dash_p = "".join(f"{ln}|\n" for ln in text.splitlines())
    header = "Cluster|NodeName|TimeStart|TimeEnd|State|Reason|User\n"
    assert parse.parse_events(dash_p) == want
    assert parse.parse_events(header + text) == want
    assert parse.parse_events(header.replace("\n", "|\n") + dash_p) == want
    line = "c|n1|2026-11-29T09:00:00|Unknown|DRAIN|gpuwarden: periodic: xid 79 [health]|root(0)|"
    (e,) = parse.parse_events(line)
    assert (e.reason, e.user) == ("gpuwarden: periodic: xid 79 [health]", "root")
    # -P lines that all have an empty user (Slurm's own events) end with "|" too: not -p.
    slurm_only = "c||2026-11-29T09:37:19|Unknown||Cluster Registered TRES|\n" \
                 "c|n2|2026-11-29T09:38:00|Unknown|DOWN*|Not responding|\n"
    assert [(e.node, e.reason, e.user) for e in parse.parse_events(slurm_only)] == \
        [("", "Cluster Registered TRES", ""), ("n2", "Not responding", "")]


def test_event_reason_may_contain_the_separator() -> None:
    line = "gpuwarden|c1|2026-11-29T09:00:00|Unknown|DRAIN|gpuwarden: a|b|root\n"
    (e,) = parse.parse_events(line)
    assert e.reason == "gpuwarden: a|b" and e.user == "root" and e.state == "DRAIN"


def test_truncated_event_line_is_an_error() -> None:
    with pytest.raises(SlurmParseError, match="line 1"):
        parse.parse_events("gpuwarden|c1|2026\n")


def test_node_view_keeps_the_controllers_clock_and_each_node_once(fixture_text: Read) -> None:
    import json

    doc = json.loads(fixture_text("scontrol_show_node_c4.json"))
    doc["nodes"] = doc["nodes"] * 2  # scontrol prints a node once per mention in its list
    view = parse.parse_node_view(json.dumps(doc))
    assert [n.name for n in view.nodes] == ["c4"] and view.ctld_time == 1795945096
    assert view.get("c4") is not None and view.get("c5") is None


def test_partition_sizes_in_the_captured_partition_shape(fixture_text: Read) -> None:
    import json

    part = json.loads(fixture_text("sinfo.json"))["sinfo"][0]["partition"]
    doc = {"partitions": [part], "last_update": {"set": True, "infinite": False, "number": 1}}
    assert parse.parse_partition_sizes(json.dumps(doc)) == {"gpu": 8}
    del part["nodes"]["total"]
    with pytest.raises(SlurmParseError, match="node total"):
        parse.parse_partition_sizes(json.dumps(doc))


def test_nodelists_from_sinfo() -> None:
    assert parse.parse_nodelists("c[4,7]\n\nc[4,7]\ngpu-b[01-02]\n") == ("c[4,7]", "gpu-b[01-02]")
    with pytest.raises(SlurmParseError, match="line 1: not a node list"):
        parse.parse_nodelists("c1 c2;reboot\n")
