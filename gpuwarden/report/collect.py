"""What the report needs of each record that the lemon attribution does not keep, tallied in
the same pass over the records (`history.from_files(..., collector=RunTally.factory(...))`).

- Runs with GPUs per (UTC day of the run's end, partition, Slurm state). A run is what the
  attribution counts as one (`kind`): named nodes and start and end times. Records that never
  ran (cancelled while pending: no nodes) are counted apart, runs without GPUs too (the MTTF
  section leaves them out).
- The runs the attribution may blame on the infrastructure, by (job id, end), with their GPUs
  and length: once the attribution is settled the blamed ones are moved to "hardware"
  (`outcomes`), and their lengths bound the work each failure lost (`ettr`). With the node
  events (`Blamable`), only runs some event could get blamed are kept, so memory grows with the
  failures the attribution keeps, not with the records.
- The starts of runs after a requeue (restart count 1 or more), by job: a blamed run's
  requeue wait is its job's next start less its end.
- With a topology: gang runs (more than one node) within one leaf switch or across leaves, and
  their queue wait (start - submit), by GPU class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.attribution import (
    GRACE_S,
    LEAD_S,
    HealthDrain,
    by_node,
    gpu_class,
    health_drains,
    node_failures,
)
from gpuwarden.accounting.columns import Columns, columns
from gpuwarden.accounting.stream import AcctRecord
from gpuwarden.report.fields import partition, submitted
from gpuwarden.slurm.hostlist import _MAX_EXPAND, HostlistError, expand
from gpuwarden.slurm.hostranges import expanded, shape
from gpuwarden.slurm.models import NodeEvent

if TYPE_CHECKING:  # polars, the store's engine, is loaded only when a store is read
    from gpuwarden.accounting.store.scan import StoreRuns
    from gpuwarden.accounting.store.schema import Batch

DAY = 86_400
BLAMABLE = frozenset({"NODE_FAIL", "BOOT_FAIL", "REQUEUED", "FAILED"})
NO_NODES = ("None assigned", "(null)")
NEVER_RAN_STATES = frozenset({"PENDING", "CANCELLED"})

Cell = tuple[int, str, str]  # (UTC day number of the end, partition, Slurm state)
GangKey = tuple[int, str]  # (GPU class, "one leaf" | "several leaves" | "unknown")
Kind = Literal["run", "never ran", "skipped"]
# What `RunTally._take` does with a store row (`RunTally._counted`).
_SKIP, _RUN, _BLAMABLE, _ASK = 0, 1, 2, 3
# The fields `RunTally._take` reads of each of the store's rows, in its order.
_ROW = ("job_id", "nodes", "state", "start_time", "end_time", "gpus", "restart_count",
        "partition", "user", "submit_time")


def run_key(job_id: int, end: int) -> int:
    """A run of a job (a requeued job has several, each with its own end)."""
    return (job_id << 32) | (end & 0xFFFF_FFFF)


def run_keys(job_ids: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]
             ) -> npt.NDArray[np.int64] | None:
    """`run_key` of each (job id, end), by numpy; None where a job id is not from 0 to
    2**31 - 1 (its key would not fit int64): the caller then goes run by run (`run_key`)."""
    if len(job_ids) and (job_ids.min() < 0 or job_ids.max() >= 1 << 31):
        return None
    return (job_ids.astype(np.int64) << 32) | (ends.astype(np.int64) & 0xFFFF_FFFF)


@lru_cache(maxsize=65_536)
def _names(nodes: str) -> tuple[str, ...] | None:
    """The node names; () for none assigned; None for a list that cannot be read."""
    if not nodes or nodes in NO_NODES:
        return ()
    known = expanded(nodes)  # shared with the judging of failed runs (`accounting.counted`)
    if known is not None:
        return known
    try:
        return tuple(expand(nodes))
    except HostlistError:
        return None


def kind(r: AcctRecord) -> Kind:
    """Whether the attribution counts ``r`` as a run, drops it silently (it never ran: no
    nodes, pending or cancelled), or skips it with a reason. The attribution's own tests
    (`lemon.attribution.attribute_runs`, `_named`), in the same order."""
    return _kind(r.nodes, r.state, r.start_time, r.end_time)


def _kind(text: str, state: str, start: int | None, end: int | None) -> Kind:
    """`kind` of a record with these fields."""
    if not (text and state not in BLAMABLE and shape(text) is not None):
        names = _names(text)
        if names is None:
            return "skipped"  # unreadable node list
        if not names:
            return "never ran" if state in NEVER_RAN_STATES else "skipped"
    if start is None or end is None or end < start:
        return "skipped"
    return "run"


def _kinds(rest: Any) -> Any:
    """Per row of the store's rows ``rest`` (a polars DataFrame), what the report's tally
    reads of its node list, worked out once per list: ``plain_``, whether `_add_plain`
    tallies it (a node list `shape` reads, a state never blamed, a start and an end that are
    not 0, the end not before the start); ``fast_``, whether `kind` reads its names (a list
    `shape` reads, a state never blamed); ``named_``, where it does, how many (-1: not
    readable)."""
    import polars as pl  # noqa: PLC0415 - the store's engine, loaded only with a store

    texts = rest.get_column("nodes").drop_nulls().unique().to_list()
    shapes = {t: known[1] for t in texts if t and (known := shape(t)) is not None}
    shaped = pl.Series(list(shapes), dtype=pl.String).implode()
    nodes, state = pl.col("nodes"), pl.col("state")
    start, end = pl.col("start_time"), pl.col("end_time")
    plain = (nodes.is_in(shaped) & ~state.is_in(sorted(BLAMABLE))
             & start.is_not_null() & (start != 0) & end.is_not_null() & (end != 0)
             & (end >= start)).fill_null(False)
    fast = (nodes.is_in(shaped)
            & (state.is_null() | ~state.is_in(sorted(BLAMABLE)))).fill_null(False)
    wanted = rest.filter(~fast).get_column("nodes").drop_nulls().unique().to_list()
    # A list `shape` reads has as many names as it counts (`hostranges.expanded`).
    counts = {t: n if (n := shapes.get(t)) is not None and n <= _MAX_EXPAND
              else -1 if (ns := _names(t)) is None else len(ns) for t in wanted}
    named = (nodes.replace_strict(counts, default=0, return_dtype=pl.Int64) if counts
             else pl.lit(0, pl.Int64))
    named = pl.when(nodes.is_null()).then(0).otherwise(named)  # `_names(None)`: ()
    # In one chunk: `replace_strict` over the store's rows in chunks (90 at a month) made its
    # table of the lists once a chunk, on every polars thread.
    return (rest.select("nodes", "state", "start_time", "end_time").rechunk()
            .select(plain.alias("plain_"), fast.alias("fast_"), named.alias("named_")))


@dataclass(frozen=True)
class Blamable:
    """The node events a failed run can be blamed through (rules 2 and 4 need one); a run no
    event can explain is one the attribution never blames, so the tally keeps nothing of it."""

    drains: Mapping[str, list[HealthDrain]]  # health-gating drains (rule 4)
    failures: Mapping[str, list[HealthDrain]]  # every node failure event (rule 2)
    grace_s: float = GRACE_S

    @classmethod
    def of(cls, events: Iterable[NodeEvent], grace_s: float = GRACE_S) -> Blamable:
        events = list(events)
        return cls(by_node(health_drains(events)), by_node(node_failures(events)), grace_s)

    def may_blame(self, state: str, nodes: str, start: int, end: int) -> bool:
        if state in ("NODE_FAIL", "BOOT_FAIL"):
            return True
        names = _names(nodes) or ()
        if state == "FAILED":
            if len(names) > 1:
                return True  # rule 3
            lo, hi, events = float(start), end + self.grace_s, self.drains  # rule 4
        else:
            lo, hi, events = end - LEAD_S, end + self.grace_s, self.failures  # rule 2
        return any(lo <= d.at <= hi for n in names for d in events.get(n, ()))


class RunTally:
    """Picklable, mergeable: each worker process fills one per file."""

    def __init__(self, leaf_of: Mapping[str, str] | None = None,
                 blamable: Blamable | None = None,
                 watch: frozenset[int] = frozenset()) -> None:
        self.leaf_of = leaf_of
        self.filter = blamable  # None: keep every run in a state the attribution may blame
        # Jobs with restore records after a restart: each of their runs (start, end), so a
        # restore is placed in the run that made it (`report.restarts`).
        self.watch = watch
        self.watched: dict[int, list[tuple[int, int]]] = {}
        # The users accounting names for each watched job (usually one; a job id Slurm gave
        # out again, more): the keys of a job's S3 restore records are derived from its uid.
        self.watched_users: dict[int, set[str]] = {}
        # Runs after a requeue (restart count 1 or more) by job: (start, restart count, user),
        # so a blamed run's requeue wait (its job's next run's start less its end) is measured
        # from accounting.
        self.requeued: dict[int, list[tuple[int, int, str]]] = {}
        self.cells: Counter[Cell] = Counter()
        self.never_ran = 0  # records of jobs that never ran (cancelled while pending)
        self.cpu_runs = 0  # runs without GPUs: not in the MTTF section, nor here
        self.gpu_seconds: Counter[int] = Counter()  # GPU class -> GPUs x seconds, exact
        # run_key -> (cell, GPUs, secs, user, restart count): the user matches a job's
        # checkpoint records and its next run, the restart count its next run's
        self.blamable: dict[int, tuple[Cell, int, int, str, int | None]] = {}
        self.gang_runs: Counter[GangKey] = Counter()
        self.gang_wait_s: Counter[GangKey] = Counter()
        self.gang_waited: Counter[GangKey] = Counter()  # runs with a submit time
        self._shared: dict[Cell, Cell] = {}
        self._users: dict[str, str] = {}

    @classmethod
    def factory(cls, leaf_of: Mapping[str, str] | None = None,
                blamable: Blamable | None = None,
                watch: frozenset[int] = frozenset()) -> partial[RunTally]:
        return partial(cls, leaf_of, blamable, watch)

    def add(self, records: Sequence[AcctRecord] | Columns, *, grouped: bool = True) -> None:
        """``grouped``: False tallies every record on its own (`_add_one`), the reference the
        grouped path is tested against."""
        cols = columns(records)
        recs = cols.records
        for i in (self._add_plain(cols) if grouped else range(len(recs))):
            self._add_one(recs[i])

    def _add_plain(self, cols: Columns) -> list[int]:
        """The runs in a state the attribution never blames (most of them), counted by cell
        and GPUs: what `_add_one` adds for each. Returns the other records' places."""
        groups: dict[tuple[int, str, str, int], list[int]] = {}
        others: list[int] = []
        recs, restarts = cols.records, cols.restarts
        watch, leaf_of, ids = self.watch, self.leaf_of, cols.job_ids if self.watch else ()
        for i, (text, shaped, state, start, end, gpus, part) in enumerate(zip(
                cols.nodes, cols.shaped, cols.states, cols.starts, cols.ends, cols.gpus,
                cols.partitions, strict=True)):
            if not shaped or state in BLAMABLE or not (start and end) or end < start:
                others.append(i)
                continue
            key = (end // DAY, part, state, gpus)
            acc = groups.get(key)
            secs = end - start if end > start else 1
            if acc is None:
                groups[key] = [1, secs]
            else:
                acc[0] += 1
                acc[1] += secs
            if watch and ids[i] in watch:
                self._watched(ids[i], start, end, recs[i].user)
            if restarts[i]:
                self._requeued(recs[i].job_id, start, restarts[i], recs[i].user)
            if leaf_of is not None and ("[" in text or "," in text):
                self._gang(recs[i], text, start)
        self._add_groups(groups.items())
        return others

    def _add_groups(self, groups: Iterable[tuple[tuple[int, str, str, int], Sequence[int]]]
                    ) -> None:
        """Runs no rule blames, by (day of the end, partition, state, GPUs): [runs, seconds]
        (each at least 1)."""
        for (day, part, state, gpus), (runs, secs) in groups:
            if gpus > 0:
                self.cells[self._cell((day, part, state))] += runs
                self.gpu_seconds[gpu_class(gpus)] += gpus * secs
            else:
                self.cpu_runs += runs

    def add_store(self, runs: StoreRuns) -> _Others:
        """The same tallies from the accounting store: its plain runs (never blamed: see
        `accounting.store.scan`) grouped on columns; the others one by one, given to what this
        returns as the attribution reads them (`scan.Others`)."""
        import polars as pl  # noqa: PLC0415 - the store's engine, loaded only with a store

        from gpuwarden.accounting.store import schema as store_schema  # noqa: PLC0415

        f = self.filter
        same = f is not None and f.grace_s == runs.grace_s and f.drains == runs.drains
        state = pl.col("state")
        # Plain one-node FAILED runs were judged with the scan's health drains: with other
        # ones (or none: every such run kept), this tally reads them itself.
        lf = runs.plain if same else runs.plain.filter(state != "FAILED")
        start, end = pl.col("start_time"), pl.col("end_time")
        secs = pl.max_horizontal(end - start, pl.lit(1))
        keys = ((end // DAY).alias("day"), pl.col("partition"), state, pl.col("gpus"))
        cells = (runs.plain_cells() if same else
                 lf.group_by(*keys).agg(pl.len(), secs.sum().alias("secs"))
                 .sort("day", "partition", "state", "gpus").collect(engine="streaming"))
        self._add_groups(((d, p, st, g), (r, sc)) for d, p, st, g, r, sc in cells.iter_rows())
        if self.watch:
            got = (lf.filter(pl.col("job_id").is_in(list(self.watch))).sort("rid")
                   .select("job_id", "start_time", "end_time", "user").collect())
            for job, a, b, user in got.iter_rows():
                self._watched(job, a, b, user)
        again = (lf.filter(pl.col("restart_count") > 0).sort("rid")
                 .select("job_id", "start_time", "restart_count", "user").collect())
        for job, a, n, user in again.iter_rows():
            self.requeued.setdefault(job, []).append((a, n, self._users.setdefault(user, user)))
        if self.leaf_of is not None:
            sub = pl.col("submit_time")
            waited = sub.is_not_null() & (sub <= start)
            gangs = (lf.filter(pl.col("nodes").str.contains(r"[\[,]"))
                     .group_by("nodes", "gpus")
                     .agg(pl.len(), pl.when(waited).then(start - sub).otherwise(0).sum()
                          .alias("wait"), waited.sum().alias("waited"))
                     .sort("nodes", "gpus").collect(engine="streaming"))
            for nodes, gpus, n, wait, w in gangs.iter_rows():
                self._gangs(nodes, gpus, n, wait, w)
        # The others as one `add` of them all (then of ``extra``) would take them: first the
        # ones `_add_plain` tallies (here), then the rest one by one, each in order (`_Others`:
        # the attribution's own records of them, a batch at a time).
        kinds = _kinds(runs.rest)
        plainish = kinds.get_column("plain_")
        for batch in runs.others(plainish):
            self.add(batch)
        codes = self._counted(runs.rest, kinds)
        extra = None if same else (runs.plain.filter(state == "FAILED").sort("rid")
                                   .select(*store_schema.READ))
        return _Others(self, codes, extra)

    def _gangs(self, nodes: str, gpus: int, runs: int, wait_s: int, waited: int) -> None:
        """`_gang` for ``runs`` runs on ``nodes`` with ``gpus``, ``waited`` of them with a
        submit time, queued ``wait_s`` in all."""
        where = self._leaves(nodes)
        if where is None:
            return
        key = (gpu_class(gpus), where)
        self.gang_runs[key] += runs
        self.gang_wait_s[key] += wait_s
        self.gang_waited[key] += waited

    def _leaves(self, nodes: str) -> str | None:
        """Where a gang run of ``nodes`` ran ("one leaf", "several leaves", "unknown"); None
        for one node or with no topology."""
        names = _names(nodes) or ()
        if len(names) < 2 or self.leaf_of is None:
            return None
        leaves = {self.leaf_of.get(n) for n in names}
        return "unknown" if None in leaves else "one leaf" if len(leaves) == 1 \
            else "several leaves"

    def _cell(self, cell: Cell) -> Cell:
        # One tuple per distinct cell: a million failed runs share a few hundred.
        return self._shared.setdefault(cell, cell)

    def _watched(self, job: int, start: int, end: int, user: str) -> None:
        self.watched.setdefault(job, []).append((start, end))
        self.watched_users.setdefault(job, set()).add(self._users.setdefault(user, user))

    def _requeued(self, job: int, start: int, restarts: int, user: str) -> None:
        self.requeued.setdefault(job, []).append(
            (start, restarts, self._users.setdefault(user, user)))

    def _blamable(self, job: int, cell: Cell, gpus: int, start: int, end: int, user: str,
                  restarts: int | None) -> None:
        """A run the attribution may blame, kept by `run_key`."""
        self.blamable[run_key(job, end)] = (
            self._cell(cell), gpus, end - start, self._users.setdefault(user, user), restarts)

    def _add_one(self, r: AcctRecord) -> None:
        what = kind(r)
        if what != "run":
            self.never_ran += what == "never ran"
            return
        start, end = r.start_time, r.end_time
        assert start is not None and end is not None  # kind() said so
        self._run(r.job_id, r.nodes, r.state, start, end, r.gpus, r.restart_count,
                  partition(r), r.user)
        if self.leaf_of is not None:
            nodes = r.nodes
            if "[" in nodes or "," in nodes:
                self._gang(r, nodes, start)

    def _run(self, job: int, nodes: str, state: str, start: int, end: int, gpus: int,
             restarts: int | None, part: str, user: str) -> None:
        """`_add_one` of a run (`kind`), less its gang."""
        cell = (end // DAY, part, state)
        if gpus > 0:
            self.cells[cell] += 1
            self.gpu_seconds[gpu_class(gpus)] += gpus * max(end - start, 1)
        else:
            self.cpu_runs += 1
        may = self.filter.may_blame if self.filter is not None else None
        if state in BLAMABLE and (may is None or may(state, nodes, start, end)):
            self._blamable(job, cell, gpus, start, end, user, restarts)
        if self.watch and job in self.watch:
            self._watched(job, start, end, user)
        if restarts:
            self._requeued(job, start, restarts, user)

    def add_frame(self, df: Any) -> None:
        """`_add_one` of each of the store's rows ``df`` (a polars DataFrame with the columns
        `store.schema.READ`), in order, without a record each: `_counted`, then `_take`. The
        same tallies in the same order as `_add_one` of each
        (tests/unit/test_report_collect_frame.py)."""
        import polars as pl  # noqa: PLC0415 - the store's engine, loaded only with a store

        from gpuwarden.accounting.store.schema import Batch  # noqa: PLC0415

        if df.is_empty():
            return
        codes = self._counted(df, _kinds(df).with_columns(pl.lit(False).alias("plain_")))
        self._take(Batch(df), codes.to_list())

    def _counted(self, df: Any, kinds: Any) -> Any:
        """The counts `_add_one` adds for the store's rows ``df`` that are not plain (by
        ``kinds``, `_kinds`'): never ran, runs per cell, GPU seconds per class, CPU runs, on
        columns, once over them all (a polars query per batch kept polars' threads awake
        for as long again). Returns what `_take` does with each row: `_SKIP`, `_RUN` (a
        run), `_BLAMABLE` (a run the attribution may blame), `_ASK` (one `Blamable.may_blame`
        says, with the node events)."""
        import polars as pl  # noqa: PLC0415 - the store's engine, loaded only with a store

        state, gpus = pl.col("state"), pl.col("gpus")
        start, end = pl.col("start_time"), pl.col("end_time")
        fast, named, plain = pl.col("fast_"), pl.col("named_"), pl.col("plain_")
        got = pl.concat([df.select("state", "gpus", "start_time", "end_time", "partition"),
                         kinds], how="horizontal")
        timed = start.is_not_null() & end.is_not_null() & (end >= start)
        ran = (~plain & (fast | (named > 0)) & timed).fill_null(False)
        self.never_ran += int(got.select((~plain & ~fast & (named == 0)
                                          & state.is_in(sorted(NEVER_RAN_STATES))).sum())
                              .item())
        runs = got.filter(ran)
        if runs.height:
            classes = {g: gpu_class(g) for g in runs.get_column("gpus").unique().to_list()}
            with_gpus = runs.filter(gpus > 0)
            # In the order each key first comes, as one `+=` a run adds them.
            for day, part, st, n in (with_gpus.group_by((end // DAY).alias("day"), "partition",
                                                        "state", maintain_order=True)
                                     .len().iter_rows()):
                self.cells[(day, part, st)] += n
            secs = gpus.cast(pl.Int64) * pl.max_horizontal(end - start, pl.lit(1))
            for g, gs in (with_gpus.group_by(gpus.replace_strict(classes, return_dtype=pl.Int64)
                                             .alias("class"), maintain_order=True)
                          .agg(secs.sum()).iter_rows()):
                self.gpu_seconds[g] += gs
            self.cpu_runs += runs.height - with_gpus.height
        # `Blamable.may_blame` says yes to these without the events: the others are asked.
        sure = (pl.lit(True) if self.filter is None else
                state.is_in(["NODE_FAIL", "BOOT_FAIL"]) | ((state == "FAILED") & (named > 1)))
        code = (pl.when(~ran).then(_SKIP)
                .when((~state.is_in(sorted(BLAMABLE))).fill_null(True)).then(_RUN)
                .when(sure).then(_BLAMABLE).otherwise(_ASK))
        return got.select(code.cast(pl.UInt8)).to_series()

    def _take(self, batch: Batch, codes: Sequence[int]) -> None:
        """What `_add_one` keeps of each run of ``batch`` (`_counted`'s ``codes``), in order:
        its blamable runs, requeues, watched jobs and gangs. Each kind in a pass of its own
        (each is kept apart from the others, so each stays in the runs' order), the blamable
        runs by column (`_blamables`): a year's million were a call and a key each."""
        col = batch.column
        code = np.frombuffer(bytes(codes), dtype=np.uint8)
        kept = np.flatnonzero(code)
        if not len(kept):
            return
        blamed = code == _BLAMABLE
        ask = np.flatnonzero(code == _ASK)
        if len(ask):
            assert self.filter is not None  # `_counted` asks only where there is a filter
            may = self.filter.may_blame
            texts, states, starts, ends = (col("nodes"), col("state"), col("start_time"),
                                           col("end_time"))
            blamed[[i for i in ask.tolist()
                    if may(states[i], texts[i], starts[i], ends[i])]] = True
        self._blamables(batch, np.flatnonzero(blamed).tolist())
        rows = kept.tolist()
        jobs, starts, users = col("job_id"), col("start_time"), col("user")
        if self.watch:
            watch, ends = self.watch, col("end_time")
            for i in rows:
                if jobs[i] in watch:
                    self._watched(jobs[i], starts[i], ends[i], users[i])
        restarts = col("restart_count")
        for i in rows:
            if restarts[i]:
                self._requeued(jobs[i], starts[i], restarts[i], users[i])
        if self.leaf_of is not None:
            texts, gpus, subs = col("nodes"), col("gpus"), col("submit_time")
            for i in rows:
                text = texts[i]
                if "[" in text or "," in text:
                    self._gang_at(text, gpus[i], starts[i], subs[i] or None)  # `submitted`

    def _blamables(self, batch: Batch, rows: list[int]) -> None:
        """`_blamable` of each run of ``batch`` at ``rows`` (in order), by column: their keys
        by numpy (`run_keys`), their values picked from the columns at once."""
        if not rows:
            return
        col = batch.column
        pick = itemgetter(*rows) if len(rows) > 1 else (lambda c: (c[rows[0]],))
        jobs, ends, starts = pick(col("job_id")), pick(col("end_time")), pick(col("start_time"))
        parts, states, gpus = pick(col("partition")), pick(col("state")), pick(col("gpus"))
        users, restarts = pick(col("user")), pick(col("restart_count"))
        end = np.array(ends, dtype=np.int64)
        got = run_keys(np.array(jobs, dtype=np.int64), end)
        if got is None:  # a job id past `run_keys`' int64: one by one
            for k in range(len(rows)):
                self._blamable(jobs[k], (ends[k] // DAY, parts[k], states[k]), gpus[k],
                               starts[k], ends[k], users[k], restarts[k])
            return
        keys = got.tolist()
        shared, known = self._shared, self._users
        cells = [shared.setdefault(c, c)
                 for c in zip((end // DAY).tolist(), parts, states, strict=True)]
        secs = (end - np.array(starts, dtype=np.int64)).tolist()
        self.blamable.update(zip(keys, zip(cells, gpus, secs,
                                           [known.setdefault(u, u) for u in users], restarts,
                                           strict=True), strict=True))

    def _gang(self, r: AcctRecord, nodes: str, start: int) -> None:
        self._gang_at(nodes, r.gpus, start, submitted(r))

    def _gang_at(self, nodes: str, gpus: int, start: int, sub: int | None) -> None:
        """`_gang` of a run on ``nodes`` with ``gpus``, submitted at ``sub`` (None: not
        known)."""
        where = self._leaves(nodes)
        if where is None:
            return
        key = (gpu_class(gpus), where)
        self.gang_runs[key] += 1
        if sub is not None and sub <= start:
            self.gang_wait_s[key] += start - sub
            self.gang_waited[key] += 1

    def merge(self, other: RunTally) -> None:
        self.cells.update(other.cells)
        self.never_ran += other.never_ran
        self.cpu_runs += other.cpu_runs
        self.gpu_seconds.update(other.gpu_seconds)
        self.blamable.update(other.blamable)
        for job, runs in other.watched.items():
            self.watched.setdefault(job, []).extend(runs)
        for job, users in other.watched_users.items():
            self.watched_users.setdefault(job, set()).update(users)
        for job, starts in other.requeued.items():
            self.requeued.setdefault(job, []).extend(starts)
        self.gang_runs.update(other.gang_runs)
        self.gang_wait_s.update(other.gang_wait_s)
        self.gang_waited.update(other.gang_waited)

    def __getstate__(self) -> dict[str, object]:
        # Back from a worker without the topology, the events (the parent has them) nor the
        # sharing memo.
        state = dict(self.__dict__)
        state["leaf_of"], state["filter"], state["_shared"], state["_users"] = None, None, {}, {}
        state["watch"] = frozenset()
        return state


class _Others:
    """The store's other runs into a `RunTally`, as one `add` of them all takes those that
    `_add_plain` does not: one by one, in order; then the plain one-node FAILED runs the tally
    judges itself (``extra``: a LazyFrame of their rows, None for none)."""

    def __init__(self, tally: RunTally, codes: Any, extra: Any) -> None:
        self._tally, self._codes, self._extra = tally, codes, extra

    def take(self, batch: Batch, at: int) -> None:
        """``batch``: the others' rows from the ``at``-th on."""
        self._tally._take(batch, self._codes.slice(at, len(batch)).to_list())

    def close(self) -> None:
        if self._extra is None:
            return
        from gpuwarden.accounting.store import schema as store_schema  # noqa: PLC0415

        for batch in store_schema.batches(self._extra.collect()):
            self._tally.add(batch)
