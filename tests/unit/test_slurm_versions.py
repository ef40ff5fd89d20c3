"""Every data_parser version's JSON (v0.0.40, Slurm 23.11 ... v0.0.45, Slurm 26.05) reads to
the same records; a field gpuwarden reads that a version's document lacks is an error that
names the field and the version. Fixtures: tests/fixtures/slurm_versions/ (generated from
SchedMD's parser tables; see its README)."""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.accounting import fastdecode as acctfast
from gpuwarden.accounting import stream as acctstream
from gpuwarden.core.errors import SlurmError, SlurmParseError
from gpuwarden.slurm import dataparser, parse
from gpuwarden.slurm.client import CliSlurmClient
from gpuwarden.slurm.models import AcctJob, Job, Node
from gpuwarden.slurm.settings import SlurmConfig
from tests.fakes import FakeRunner, ok

DIR = Path(__file__).resolve().parent.parent / "fixtures" / "slurm_versions"
VERSIONS = [f"v0.0.{n}" for n in range(40, 46)]
NO_VAL64 = 18446744073709551614

NODE = Node(name="c4", state=("IDLE", "DRAIN"), reason="gpuwarden: xid 79 on GPU 3",
            reason_set_by="root", reason_changed_at=1767225600, partitions=("gpu",),
            gres="gpu:h100:8", features=("h100", "ib"), boot_time=1767139200)
ACCT = AcctJob(job_id=1234, name="train", user="alice", state="NODE_FAIL", state_reason="None",
               partition="gpu", nodes="c[3-4]", num_nodes=2, gpus=16, exit_code=None, signal=9,
               submit_time=1767225600, start_time=1767225660, end_time=1767229200,
               restart_count=0, failed_node="c4",
               submit_line="sbatch -N2 --gpus-per-node=8 train.sbatch")
JOB = Job(job_id=1235, name="train", user="alice", state=("RUNNING",), state_reason="None",
          partition="gpu", nodes="c[3-4]", num_nodes=2, restart_count=0, exit_code=0,
          admin_comment="", comment="", end_time=1767229200, req_switch=1, switch_wait_s=300)


def doc(command: str, version: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DIR / f"{command}_{version}.json").read_text())
    return loaded


def expected_acct(version: str) -> AcctJob:
    # restart_cnt is printed from v0.0.42 on: before, the count is unknown, not 0.
    restart = None if version in ("v0.0.40", "v0.0.41") else 0
    return AcctJob(**{**ACCT.__dict__, "restart_count": restart})


def sacct_text(d: dict[str, Any], records: int = 1, compact: bool = False) -> str:
    """The fixture's record ``records`` times (job ids 1234, 1235, ...)."""
    d = copy.deepcopy(d)
    jobs = []
    for i in range(records):
        rec = copy.deepcopy(d["jobs"][0])
        rec["job_id"] = 1234 + i
        jobs.append(rec)
    d["jobs"] = jobs
    return json.dumps(d, separators=(",", ":")) if compact else json.dumps(d, indent=2)


def streamed(text: str, fast: bool, version: str | None) -> list[Any]:
    buf = io.StringIO(text)
    return list(acctstream.AcctStream(buf.read, fast=fast, version=version))


@pytest.mark.parametrize("version", VERSIONS)
def test_each_version_names_its_data_parser(version: str) -> None:
    for command in ("sacct", "sinfo", "scontrol_show_node", "scontrol_show_job",
                    "scontrol_show_partition"):
        assert dataparser.version(doc(command, version)) == version


@pytest.mark.parametrize(("meta", "version"), [
    ({"plugin": {"data_parser": "v0.0.40"}}, "v0.0.40"),  # 23.11/24.05: the raw --json=v0.0.40
    ({"plugin": {"data_parser": "data_parser/v0.0.42+complex"}}, "v0.0.42"),
    ({"plugin": {"data_parser": "data_parser\\/v0.0.43"}}, "v0.0.43"),
    # No plugin named: the release's default.
    ({"slurm": {"version": {"major": "24", "minor": "05", "micro": "8"}}}, "v0.0.41"),
    ({"plugin": {"data_parser": ""}, "slurm": {"release": "26.05.3"}}, "v0.0.45"),
    ({"slurm": {"release": "22.05.1"}}, None),
    ({}, None),
])
def test_version_from_either_layout_of_meta(meta: dict[str, Any], version: str | None) -> None:
    assert dataparser.version({"meta": meta}) == version
    assert dataparser.version(meta) == version


@pytest.mark.parametrize("version", VERSIONS)
def test_nodes_read_the_same_in_every_version(version: str) -> None:
    text = json.dumps(doc("scontrol_show_node", version))
    assert parse.parse_nodes(text) == [NODE]
    view = parse.parse_node_view(text)
    assert view.nodes == (NODE,) and view.ctld_time == 1767225660


@pytest.mark.parametrize("version", VERSIONS)
def test_sinfo_names_who_set_the_reason_in_every_version(version: str) -> None:
    # v0.0.45 moved reason.user to the entry's reason_set_by_user: without reading it, an
    # operator's drain read by the quick peek would look like Slurm's own.
    d = doc("sinfo", version)
    d["sinfo"][0]["reason"]["description"] = "maintenance"
    node = parse.parse_sinfo_node(json.dumps(d), "c4")
    assert node is not None and node.reason_set_by == "root" and node.owner == "root"
    assert node.state == NODE.state and node.partitions == ("gpu",)
    assert node.reason_changed_at == 1767225600 and node.features == ("h100", "ib")
    assert parse.parse_sinfo_partitions(json.dumps(d)) == {"gpu": ("c4",)}


@pytest.mark.parametrize("version", VERSIONS)
def test_jobs_and_partitions_read_the_same_in_every_version(version: str) -> None:
    assert parse.parse_jobs(json.dumps(doc("scontrol_show_job", version))) == [JOB]
    sizes = parse.parse_partition_sizes(json.dumps(doc("scontrol_show_partition", version)))
    assert sizes == {"gpu": 8}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("compact", [False, True], ids=["pretty", "SLURM_JSON=compact"])
def test_sacct_reads_the_same_whole_or_streamed_in_every_version(version: str,
                                                                 compact: bool) -> None:
    d = doc("sacct", version)
    want = expected_acct(version)
    assert list(parse.iter_acct_jobs(sacct_text(d))) == [want]
    text = sacct_text(d, records=300, compact=compact)
    wants = [AcctJob(**{**want.__dict__, "job_id": 1234 + i}) for i in range(300)]
    assert streamed(text, fast=False, version=None) == wants
    assert streamed(text, fast=True, version=None) == wants
    assert streamed(text, fast=True, version=version) == wants


@pytest.mark.parametrize("version", VERSIONS)
def test_unset_times_read_as_unset_in_every_version(version: str) -> None:
    # NO_VAL64 is printed as null up to v0.0.42 and raw from v0.0.43 on: both mean unset.
    unset = NO_VAL64 if version >= "v0.0.43" else None
    d = doc("sacct", version)
    d["jobs"][0]["time"]["end"] = unset
    d["jobs"][0]["time"]["start"] = unset
    (rec,) = parse.iter_acct_jobs(sacct_text(d))
    assert isinstance(rec, AcctJob) and rec.end_time is None and rec.start_time is None
    for got in streamed(sacct_text(d, records=50), fast=True, version=version):
        assert got.end_time is None and got.start_time is None
    s = doc("sinfo", version)
    s["sinfo"][0]["reason"]["time"] = unset
    node = parse.parse_sinfo_node(json.dumps(s), "c4")
    assert node is not None and node.reason_changed_at is None


def leaf_paths(spec: dataparser.Spec, prefix: str = "") -> Iterator[str]:
    nested = dict(spec.nested)
    for key in spec.keys:
        if key in nested:
            yield from leaf_paths(nested[key], f"{prefix}{key}.")
        else:
            yield prefix + key


def without(d: dict[str, Any], path: str) -> dict[str, Any]:
    d = copy.deepcopy(d)
    *parents, last = path.split(".")
    at = d
    for p in parents:
        at = at[p]
    del at[last]
    return d


@pytest.mark.parametrize("version", VERSIONS)
def test_any_missing_sacct_field_is_named_with_the_version(version: str) -> None:
    d = doc("sacct", version)
    for path in leaf_paths(dataparser.sacct_spec(version)):
        bad = copy.deepcopy(d)
        bad["jobs"] = [d["jobs"][0], d["jobs"][0], without(d["jobs"][0], path)]
        recs = list(parse.iter_acct_jobs(json.dumps(bad)))
        assert isinstance(recs[0], AcctJob) and isinstance(recs[2], SlurmParseError)
        assert str(recs[2]) == f"sacct --json (data_parser {version}): jobs[2].{path} missing"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("fast", [True, False], ids=["msgspec", "stdlib"])
def test_a_streamed_record_missing_a_field_is_named_by_its_place(version: str,
                                                                 fast: bool) -> None:
    d = doc("sacct", version)
    text = sacct_text(d, records=200, compact=True)
    broken = json.loads(text)
    del broken["jobs"][137]["time"]["end"]
    recs = streamed(json.dumps(broken), fast=fast, version=version)
    errors = [(i, str(r)) for i, r in enumerate(recs) if not isinstance(r, AcctJob)]
    assert errors == [(137, f"sacct --json (data_parser {version}): jobs[137].time.end missing")]
    assert len(recs) == 200
    # Given no version, the stream reads it leniently, as it did before (an unknown end).
    lenient = streamed(json.dumps(broken), fast=fast, version=None)
    assert all(isinstance(r, AcctJob) for r in lenient) and lenient[137].end_time is None


def test_restart_count_is_required_from_the_version_that_prints_it() -> None:
    d = doc("sacct", "v0.0.42")
    del d["jobs"][0]["restart_cnt"]
    (rec,) = parse.iter_acct_jobs(json.dumps(d))
    assert isinstance(rec, SlurmParseError) and "jobs[0].restart_cnt missing" in str(rec)
    d["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.41"
    (rec,) = parse.iter_acct_jobs(json.dumps(d))
    assert isinstance(rec, AcctJob) and rec.restart_count is None


@pytest.mark.parametrize("version", VERSIONS)
def test_any_missing_node_field_is_an_error_naming_it(version: str) -> None:
    d = doc("scontrol_show_node", version)
    for path in leaf_paths(dataparser.NODE):
        bad = copy.deepcopy(d)
        bad["nodes"][0] = without(d["nodes"][0], path)
        with pytest.raises(SlurmParseError) as err:
            parse.parse_nodes(json.dumps(bad))
        want = f"scontrol show nodes --json (data_parser {version}): nodes[0].{path} missing"
        assert str(err.value) == want


@pytest.mark.parametrize("version", VERSIONS)
def test_any_missing_sinfo_field_is_an_error_naming_it(version: str) -> None:
    d = doc("sinfo", version)
    for path in leaf_paths(dataparser.sinfo_spec(version)):
        bad = copy.deepcopy(d)
        bad["sinfo"][0] = without(d["sinfo"][0], path)
        with pytest.raises(SlurmParseError, match=rf"\(data_parser {version}\): "
                                                  rf"sinfo\[0\]\.{path} missing"):
            parse.parse_sinfo_node(json.dumps(bad), "c4")


@pytest.mark.parametrize("version", VERSIONS)
def test_any_missing_job_field_is_an_error_naming_it(version: str) -> None:
    d = doc("scontrol_show_job", version)
    for path in leaf_paths(dataparser.JOB):
        bad = copy.deepcopy(d)
        bad["jobs"][0] = without(d["jobs"][0], path)
        with pytest.raises(SlurmParseError, match=rf"\(data_parser {version}\): "
                                                  rf"jobs\[0\]\.{path} missing"):
            parse.parse_jobs(json.dumps(bad))
    bad = copy.deepcopy(doc("scontrol_show_partition", version))
    del bad["partitions"][0]["nodes"]["total"]
    with pytest.raises(SlurmParseError, match=rf"\(data_parser {version}\): "
                                              r"partitions\[0\]\.nodes\.total missing"):
        parse.parse_partition_sizes(json.dumps(bad))


def test_a_26_05_sinfo_read_as_an_older_shape_is_an_error_not_an_empty_owner() -> None:
    # The shape of v0.0.44 (reason.user) in a document that says v0.0.45: the schema moved.
    d = doc("sinfo", "v0.0.44")
    d["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.45"
    with pytest.raises(SlurmParseError, match=r"v0\.0\.45\): sinfo\[0\]\.reason_set_by_user"):
        parse.parse_sinfo_node(json.dumps(d), "c4")


def test_an_object_of_the_wrong_type_is_named_not_a_traceback() -> None:
    d = doc("sacct", "v0.0.43")
    d["jobs"][0]["time"] = None
    (rec,) = parse.iter_acct_jobs(json.dumps(d))
    assert str(rec) == ("sacct --json (data_parser v0.0.43): jobs[0].time: expected an object,"
                        " found null")
    d["jobs"][0] = [1, 2]
    recs = streamed(json.dumps({**d, "jobs": d["jobs"] * 3}), fast=True, version="v0.0.43")
    assert all(isinstance(r, SlurmParseError) and "expected an object, found a list" in str(r)
               for r in recs)


def test_a_newer_version_is_read_with_the_newest_shape_known() -> None:
    d = doc("sinfo", "v0.0.45")
    d["meta"]["plugin"]["data_parser"] = "data_parser/v0.0.46"
    node = parse.parse_sinfo_node(json.dumps(d), "c4")
    assert node is not None and node.reason_set_by == "root"


# meta.command before 26.05.2 lacks argv's last element: gpuwarden puts --json last so that
# the window survives.
@pytest.mark.parametrize("version", VERSIONS)
def test_the_window_survives_meta_command_in_every_version(version: str) -> None:
    argv = acctstream.SacctStream(lambda: "sacct", 5).argv("2026-01-01T00:00:00",
                                                           "2026-01-02T00:00:00")
    assert argv[-1] == "--json"
    d = doc("sacct", version)
    complete = dataparser.command_complete(d)
    assert complete is (version == "v0.0.45")  # the fixtures' 26.05.3 has the fix
    d["meta"]["command"] = argv if complete else argv[:-1]
    assert parse.acct_window(d) == (1767225600.0, 1767312000.0)


@pytest.mark.parametrize("command", [
    ["sacct", "--json", "--starttime=2026-01-01T00:00:00"],  # --endtime= lost
    ["sacct", "--json", "-S", "2026-01-01T00:00:00", "-E"],  # -E's value lost
])
def test_a_window_whose_end_was_lost_has_an_unknown_end(command: list[str]) -> None:
    d = doc("sacct", "v0.0.42")
    d["meta"]["command"] = command
    assert dataparser.command_complete(d) is False
    assert parse.acct_window(d) == (1767225600.0, None)
    d["meta"]["command"] = ["sacct", "--json", "-S"]  # the repo's 24.11.5 capture
    assert parse.acct_window(d) == (None, None)


def test_client_asks_sacct_with_json_last() -> None:
    runner = FakeRunner(script=[lambda a: ok(a, json.dumps(doc("sacct", "v0.0.43")))])
    client = CliSlurmClient(SlurmConfig(), runner)
    recs = list(client.acct_jobs("2026-01-01T00:00:00", "2026-01-02T00:00:00"))
    assert runner.calls[0][-1] == "--json" and "--endtime=2026-01-02T00:00:00" in runner.calls[0]
    assert recs == [expected_acct("v0.0.43")]


@pytest.mark.parametrize("version", VERSIONS)
def test_an_export_file_names_its_version_and_window(tmp_path: Path, version: str) -> None:
    d = doc("sacct", version)
    path = tmp_path / "day.json"
    path.write_text(sacct_text(d, records=20))
    with acctstream.open_regular(str(path)) as fh:
        assert acctstream.file_version(fh) == version
        assert acctstream.file_window(fh) == parse.acct_window(d)
        recs = list(acctstream.AcctStream(acctstream.text_reader(fh),
                                          version=acctstream.file_version(fh)).runs())
    assert [r.job_id for r in recs if not isinstance(r, SlurmError)] == list(range(1234, 1254))


def test_strict_fast_decoder_is_used_only_where_msgspec_is() -> None:
    if acctfast.DECODER is None:
        assert acctfast.decoder_for("v0.0.43") is None
    else:
        assert acctfast.decoder_for(None) is acctfast.DECODER
        assert acctfast.decoder_for("v0.0.43") is not acctfast.DECODER


# ---- a field of another type is an error, not a default (issue 17) ----------------------------
@pytest.mark.parametrize(("field", "value", "expected"), [
    ("state", 5, "a list of strings, found a number"),
    ("state", {"flags": ["DRAIN"]}, "a list of strings, found dict"),
    ("state", [1, 2], "a list of strings"),
    ("reason", ["gpuwarden: xid 79"], "a string, found a list"),
    ("extra", {"gpuwarden": "ok"}, "a string, found dict"),
])
def test_a_node_field_of_another_type_names_field_and_version(field: str, value: object,
                                                              expected: str) -> None:
    doc = json.loads((DIR / "scontrol_show_node_v0.0.45.json").read_text())
    doc["nodes"][0][field] = value
    with pytest.raises(SlurmParseError) as err:
        parse.parse_nodes(json.dumps(doc))
    assert f"(data_parser v0.0.45): nodes[0].{field}: expected {expected}" in str(err.value)


def test_a_job_state_of_another_type_names_field_and_version() -> None:
    doc = json.loads((DIR / "scontrol_show_job_v0.0.42.json").read_text())
    doc["jobs"][0]["job_state"] = "RUNNING"
    with pytest.raises(SlurmParseError, match=r"v0\.0\.42\): jobs\[0\]\.job_state: expected a "
                       r"list of strings, found a string"):
        parse.parse_jobs(json.dumps(doc))
