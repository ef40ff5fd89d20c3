"""Output captured from the real Slurm 26.05.5 test cluster (GPUWARDEN_SLURM=26.05, Debian
forky; tests/fixtures/slurm_26.05/, sacct trimmed to a few jobs of each state): every parser
reads it, as it reads the 24.11.5 captures beside it."""

from __future__ import annotations

from pathlib import Path

from gpuwarden.accounting import history
from gpuwarden.slurm import dataparser, parse
from gpuwarden.slurm.models import AcctJob

CAPTURED = Path(__file__).parent.parent / "fixtures" / "slurm_26.05"


def text(name: str) -> str:
    return (CAPTURED / name).read_text()


def test_the_captures_are_26_05s_data_parser() -> None:
    for name in ("sacct.json", "sinfo.json", "scontrol_show_nodes.json"):
        assert dataparser.version(parse.load_json(text(name), name)) == "v0.0.45", name


def test_nodes_sinfo_jobs_and_partitions_read() -> None:
    nodes = parse.parse_nodes(text("scontrol_show_nodes.json"))
    assert [n.name for n in nodes] == [f"c{i}" for i in range(1, 9)]
    assert all(n.state for n in nodes)
    c1 = parse.parse_sinfo_node(text("sinfo.json"), "c1")
    assert c1 is not None and c1.name == "c1"
    (job,) = parse.parse_jobs(text("scontrol_show_job.json"))
    assert job.job_id > 0 and job.user == "alice" and job.state
    assert parse.parse_partition_sizes(text("scontrol_show_partition.json")) == {"gpu": 8}


def test_sacct_reads_whole_and_streamed_with_its_window() -> None:
    whole = [r for r in parse.iter_acct_jobs(text("sacct.json"))]
    assert whole and all(isinstance(r, AcctJob) for r in whole)
    states = {r.state for r in whole if isinstance(r, AcctJob)}
    assert {"COMPLETED", "FAILED", "NODE_FAIL", "CANCELLED"} <= states
    # 26.05.5 keeps sacct's whole argv in meta.command: the window's start is there.
    start, _ = parse.acct_window(parse.load_json(text("sacct.json"), "sacct"))
    assert start is not None
    hist = history.from_files([str(CAPTURED / "sacct.json")], [], 3600)
    assert not hist.attribution.skipped.get(f"{CAPTURED / 'sacct.json'}: malformed record")
    assert hist.records == len(whole)
