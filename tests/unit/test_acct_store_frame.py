"""The store's rows made fast (issue 36, cold ingest): `fastdecode.flat_of` reads each record's
fields as its AcctJob holds them, whatever shape sacct printed them in; `files.by_day` splits
rows by day as `partition_by` does; `ingest.frames` takes a batch's errors out in order."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import msgspec
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting import fastdecode as acctfast
from gpuwarden.accounting.store import files, ingest, schema
from gpuwarden.core.errors import SlurmParseError
from gpuwarden.slurm.dataparser import PLACEHOLDER
from gpuwarden.slurm.models import AcctJob

_INT = st.one_of(st.integers(-3, 300), st.integers(1, 1 << 40),
                 st.sampled_from([0, PLACEHOLDER - 1, PLACEHOLDER, PLACEHOLDER + 1,
                                  (1 << 64) - 2]))
NUMBER = st.one_of(st.none(), _INT, st.fixed_dictionaries(
    {"set": st.booleans(), "infinite": st.booleans(), "number": st.one_of(st.none(), _INT)}))
TEXT = st.one_of(st.none(), st.sampled_from(["", "a", "n[01-02]", "gpu", "gres"]))
TRES = st.fixed_dictionaries({"type": TEXT, "name": TEXT, "count": NUMBER})


def _maybe(d: dict[str, Any]) -> st.SearchStrategy[Any]:
    """``d``'s keys, each there or not; or null."""
    return st.one_of(st.none(), st.fixed_dictionaries({}, optional=d))


RECORD = st.fixed_dictionaries({"job_id": NUMBER}, optional={
    "name": TEXT, "user": TEXT, "partition": TEXT, "nodes": TEXT, "failed_node": TEXT,
    "submit_line": TEXT, "allocation_nodes": NUMBER, "restart_cnt": NUMBER,
    "state": _maybe({"current": st.one_of(TEXT, st.lists(st.sampled_from(
        ["FAILED", "REQUEUED", "COMPLETED", ""]), max_size=3)), "reason": TEXT}),
    "time": _maybe({"submission": NUMBER, "start": NUMBER, "end": NUMBER}),
    "exit_code": _maybe({"return_code": NUMBER, "signal": _maybe({"id": NUMBER})}),
    "tres": _maybe({"allocated": st.one_of(st.none(), st.lists(TRES, max_size=4))}),
})
PLAIN = st.fixed_dictionaries({
    "job_id": st.integers(1, 1 << 40), "name": TEXT, "user": TEXT, "partition": TEXT,
    "nodes": TEXT, "failed_node": TEXT, "submit_line": TEXT, "allocation_nodes": NUMBER,
    "restart_cnt": NUMBER,
    "state": st.fixed_dictionaries({"current": st.lists(st.sampled_from(["FAILED", ""]),
                                                        min_size=1, max_size=1),
                                    "reason": TEXT}),
    "time": st.fixed_dictionaries({"submission": NUMBER, "start": NUMBER, "end": NUMBER}),
    "exit_code": st.fixed_dictionaries({"return_code": NUMBER,
                                        "signal": _maybe({"id": NUMBER})}),
    "tres": _maybe({"allocated": st.one_of(st.none(), st.lists(TRES, max_size=4))}),
})
JOB = AcctJob(7, "n", "u", "FAILED", "r", "p", "c1", 1, 8, 1, None, 5, 6, 7, None, "c1", "x")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(RECORD, PLAIN, st.just(None)), max_size=8))
def test_flat_rows_are_each_records_acctjob_fields(items: list[dict[str, Any] | None]) -> None:
    """Whatever the shapes (plain ints, wrappers, placeholders, nulls, a state's string or
    list, AcctJobs among the Runs), each record's values are its AcctJob's, in order."""
    runs = msgspec.json.decode(msgspec.json.encode([i for i in items if i is not None]),
                               type=list[acctfast.Run])
    each = iter(runs)
    records: list[Any] = [JOB if i is None else next(each) for i in items]
    ints, strs = acctfast.flat_of(records)
    jobs = [r if isinstance(r, AcctJob) else r.job() for r in records]
    assert ints == [v for j in jobs for v in attrgetter(*acctfast.INTS)(j)]
    assert strs == [v for j in jobs for v in attrgetter(*acctfast.STRS)(j)]


def test_the_store_frame_holds_each_records_fields_in_the_schemas_columns() -> None:
    runs = msgspec.json.decode(msgspec.json.encode([
        {"job_id": 3, "name": "a", "user": "u", "state": {"current": ["FAILED"], "reason": "x"},
         "partition": "p", "nodes": "c[1-2]", "allocation_nodes": 2,
         "time": {"submission": 1, "start": 2, "end": 86_400 * 3},
         "exit_code": {"return_code": {"set": True, "infinite": False, "number": 1},
                       "signal": {"id": {"set": False, "infinite": False, "number": 0}}},
         "tres": {"allocated": [{"type": "gres", "name": "gpu", "count": 16}]},
         "restart_cnt": 1, "failed_node": "c1", "submit_line": "sbatch x"}]),
        type=list[acctfast.Run])
    df = schema.frame([JOB, runs[0]], [])
    assert df.schema == schema.SCHEMA
    assert df.rows() == [tuple(attrgetter(*schema.NAMES)(j)) for j in (JOB, runs[0].job())]


@given(st.lists(st.one_of(st.none(), st.integers(0, 5 * 86_400)), max_size=30))
def test_rows_by_day_are_partition_bys_groups_in_order(ends: list[int | None]) -> None:
    """Days together (slices) or apart (partitioned): the same groups, rows and order."""
    df = pl.DataFrame({"end_time": ends, "job_id": range(len(ends))},
                      schema={"end_time": pl.Int64, "job_id": pl.Int64})
    want = [(p.get_column("_day")[0], p.drop("_day")) for p in df.with_columns(
        (pl.col("end_time") // files.DAY_S).alias("_day")).partition_by(
        "_day", maintain_order=True, include_key=True)] if ends else []
    got = list(files.by_day(df)) if ends else []
    assert [d for d, _ in got] == [d for d, _ in want]
    assert all(a.equals(b) for (_, a), (_, b) in zip(got, want, strict=True))


def test_a_batchs_errors_are_taken_out_in_order_and_its_records_kept_in_order() -> None:
    jobs = [JOB.__class__(**{**JOB.__dict__, "job_id": i}) for i in range(6)]
    err = [SlurmParseError(f"bad {i}") for i in range(2)]
    bad: list[str] = []
    got = list(ingest.frames([[jobs[0], err[0], jobs[1]], jobs[2:4], [err[1]], jobs[4:]], bad))
    assert bad == ["bad 0", "bad 1"]
    assert pl.concat(got).get_column("job_id").to_list() == list(range(6))


def test_a_days_rows_read_in_several_batches_are_written_as_one_run_of_rows() -> None:
    """An export's frames are read a batch at a time: a day's slice across them is made one
    (its Parquet file one row group, the size it had when the days were partitioned)."""
    df = pl.concat([pl.DataFrame({"end_time": [files.DAY_S * d + i for i in range(3)]},
                                 schema={"end_time": pl.Int64}) for d in (1, 1, 2)])
    assert df.n_chunks() == 3
    got = list(files.by_day(df))
    assert [(d, p.height, p.n_chunks()) for d, p in got] == [(1, 6, 1), (2, 3, 1)]
