"""The store's columns: one row per job record, the fields of `slurm.models.AcctJob` as the
readers read them (a time or count Slurm left unset is null). Pure.

Bump `VERSION` when a column changes meaning, type or name, or the layout changes: a store of
another version is refused (`manifest.load`), never read half-right. Version 2: each runs
file has its rollup (`store.rollup`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import polars as pl

from gpuwarden.accounting import fastdecode as acctfast
from gpuwarden.accounting.stream import AcctRecord
from gpuwarden.slurm.models import AcctJob

VERSION = 2


@dataclass(frozen=True)
class Column:
    name: str
    dtype: Any  # a polars data type
    meaning: str


COLUMNS: tuple[Column, ...] = (
    Column("job_id", pl.Int64, "the job id (a requeued job has one row per run)"),
    Column("name", pl.String, "the job name"),
    Column("user", pl.String, "the user who ran it"),
    Column("state", pl.String, "the run's state as gpuwarden reads it: REQUEUED when Slurm "
           "lists it, else the first state (COMPLETED, FAILED, NODE_FAIL, ...)"),
    Column("state_reason", pl.String, "Slurm's state reason"),
    Column("partition", pl.String, "the partition"),
    Column("nodes", pl.String, "the node list as sacct prints it (a hostlist, n[0001-0004])"),
    Column("num_nodes", pl.Int32, "nodes allocated (allocation_nodes)"),
    Column("gpus", pl.Int32, "GPUs allocated (tres.allocated gres/gpu; 0 without)"),
    Column("exit_code", pl.Int32, "the return code; null when unset"),
    Column("signal", pl.Int32, "the signal that ended it; null when none"),
    Column("submit_time", pl.Int64, "submitted, epoch seconds UTC; null when unset"),
    Column("start_time", pl.Int64, "started, epoch seconds UTC; null when it never started"),
    Column("end_time", pl.Int64, "ended, epoch seconds UTC; null while running"),
    Column("restart_count", pl.Int32, "requeues before this run (restart_cnt); null where "
           "accounting does not say (data_parser before v0.0.42)"),
    Column("failed_node", pl.String, "the node Slurm recorded as failed (NODE_FAIL)"),
    Column("submit_line", pl.String, "the submit command (sbatch -w ... train.sh)"),
)
SCHEMA = pl.Schema({c.name: c.dtype for c in COLUMNS})
NAMES = tuple(c.name for c in COLUMNS)
assert tuple(f.name for f in fields(AcctJob)) == NAMES, "the store's row is an AcctJob"


# Where a 32-bit column's value comes from in `sacct --json`, for the message naming it.
_FROM = {"num_nodes": "allocation_nodes", "gpus": "tres.allocated gres/gpu count",
         "exit_code": "exit_code.return_code", "signal": "exit_code.signal.id",
         "restart_count": "restart_cnt"}
_INT32 = tuple(c.name for c in COLUMNS if c.dtype == pl.Int32)
_LO, _HI = -(1 << 31), (1 << 31) - 1
# The store's columns as `acctfast.flat_of` gives them: its int fields, then its strings.
_GROUPS = (acctfast.INTS, acctfast.STRS)
assert sorted(acctfast.INTS + acctfast.STRS) == sorted(NAMES)
assert all((SCHEMA[n] == pl.String) == (n in acctfast.STRS) for n in NAMES)


def frame(records: Sequence[AcctRecord], bad: list[str]) -> pl.DataFrame:
    """``records`` as rows of the store (the fast decoder's structs read without building an
    AcctJob each). A record with a count the store's 32-bit columns cannot hold (under Slurm's
    placeholder, so the readers take it) is left out and said in ``bad``: it is that record's
    problem, not the export's."""
    if not records:
        return SCHEMA.to_frame()
    ints, strs = acctfast.flat_of(list(records))
    # Two Series, cut into columns by gather_every: polars builds a Series from one long list
    # faster than from many, and no tuple per record is built and transposed.
    whole = (pl.Series(ints, dtype=pl.Int64), pl.Series(strs, dtype=pl.String))
    cut = {name: whole[kind].gather_every(len(group), at)
           for kind, group in enumerate(_GROUPS) for at, name in enumerate(group)}
    wide = pl.DataFrame([cut[name].alias(name) for name in NAMES])
    over = pl.any_horizontal([pl.col(c).is_not_null() & ~pl.col(c).is_between(_LO, _HI)
                              for c in _INT32])
    odd = wide.filter(over)
    if odd.height:
        for row in odd.iter_rows(named=True):
            name = next(c for c in _INT32 if row[c] is not None and not _LO <= row[c] <= _HI)
            bad.append(f"job {row['job_id']}: {_FROM[name]} {row[name]} is more than the "
                       f"store's 32-bit column {name} holds (left out)")
        wide = wide.filter(~over)
    return wide.cast(dict.fromkeys(_INT32, pl.Int32))


# What the attribution and the report's tally read of a record that they judge one by one
# (`accounting.attribution`, `accounting.counted`, `report.collect`): the store's failed runs
# are read with these columns only, the others standing unset in the records made of them
# (a year holds 6 million failed runs: every column read is memory).
UNREAD: dict[str, Any] = {"name": "", "state_reason": "", "num_nodes": 0, "signal": None}
READ = tuple(n for n in NAMES if n not in UNREAD)
BATCH = 50_000  # records made at once (`batches`): bounds the objects held


class Batch:
    """Rows of the store by column, each column made a list once, on first read: what the
    failed runs are judged with (`counted.Rows`) and the report tallies them with, without a
    record per row (a year's million records were a tenth of its report); records only of the
    few rows the per-record rules read (`records`). A column of `UNREAD` that the rows leave
    out stands unset in each."""

    __slots__ = ("_cols", "_df")

    def __init__(self, df: pl.DataFrame) -> None:
        self._df = df
        self._cols: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return self._df.height

    @property
    def frame(self) -> pl.DataFrame:
        """The rows."""
        return self._df

    def column(self, name: str) -> list[Any]:
        got = self._cols.get(name)
        if got is None:
            got = self._cols[name] = (self._df.get_column(name).to_list()
                                      if name in self._df.columns
                                      else [UNREAD[name]] * self._df.height)
        return got

    def records(self, lo: int = 0, hi: int | None = None) -> list[AcctJob]:
        """The rows from ``lo`` to ``hi`` (the end: None) as records."""
        if hi is None:
            hi = self._df.height
        if lo >= hi:
            return []
        cols = [self.column(c)[lo:hi] for c in NAMES]
        return [_job(row) for row in zip(*cols, strict=True)]


def jobs(df: pl.DataFrame) -> list[AcctJob]:
    """Rows back as the records the attribution reads (for the few runs judged one by one); a
    column of `UNREAD` that ``df`` leaves out stands unset in each."""
    return Batch(df).records() if df.height else []


def row_batches(df: pl.DataFrame) -> Iterator[Batch]:
    """``df`` as `Batch`es of `BATCH` rows, in order: only a batch of rows is held as
    objects at once."""
    size = BATCH
    for at in range(0, df.height, size):
        yield Batch(df.slice(at, size))


def _job(row: tuple[Any, ...], _new: Callable[[type[AcctJob]], AcctJob] = object.__new__,
         _names: tuple[str, ...] = NAMES) -> AcctJob:
    """``AcctJob(*row)``, its fields filled directly: the dataclass's __init__ sets each frozen
    field through object.__setattr__ (17 calls a record)."""
    job = _new(AcctJob)
    job.__dict__.update(zip(_names, row, strict=True))
    return job


def batches(df: pl.DataFrame) -> Iterator[list[AcctJob]]:
    """`jobs` of ``df``, `BATCH` rows at a time, in order."""
    size = BATCH
    for at in range(0, df.height, size):
        yield jobs(df.slice(at, size))
