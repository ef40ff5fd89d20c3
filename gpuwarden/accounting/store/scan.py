"""The store read back for the attribution and the report's tally, on columns (polars).

Most runs are ones no rule can blame on a node: a state never blamed (COMPLETED, TIMEOUT...),
or a one-node FAILED run with no health drain of its node while it ran or within the grace
after (rule 4: the user's). Those ("plain") are tallied by group in polars: runs and
run-seconds per node list and per GPU count for the attribution (`add_plain_groups`), per
(day, partition, state, GPUs) for the report (`RunTally.add_store`). The failed runs an event
or a gang may explain have their exposure tallied with them when their node list is one
`shape` reads (`counted.countable`, no node with a cleared lemon drain), and are judged by node
list (`counted.Judge`). The rest (node lists of another shape, nodes whose lemon drain was
cleared, runs without times) go through the per-record rules one by one, in store order
with the failed runs. Both paths give the same figures as an export's
(tests/unit/test_acct_store_golden.py, test_attribution_counted.py). The groups over every
timed run (per node list and GPUs, per source, per outcome cell) are summed from the files'
rollups (`store.rollup`), made from the rows for the days a read `since` takes in part.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import polars as pl

from gpuwarden.accounting.attribution import (
    Attribution,
    HealthDrain,
    add_exposure,
    add_plain_groups,
    add_plain_sizes,
    size_bucket,
)
from gpuwarden.accounting.counted import attribute_rest
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.store import nodelists, rollup, schema
from gpuwarden.slurm.models import AcctJob

log = logging.getLogger(__name__)

BLAMABLE = ("NODE_FAIL", "BOOT_FAIL", "REQUEUED", "FAILED")
NO_NODES = ("", "None assigned", "(null)")
SECS = rollup.SECS


@dataclass(frozen=True)
class StoreRuns:
    """What a collector (`history.Collector.add_store`) reads of the store: the plain runs
    as a LazyFrame of store rows, the others' rows (``rest``, in store order, with the columns
    `schema.READ`: `others` makes them records, as the attribution read them), and the health
    drains and grace the one-node FAILED runs in ``plain`` were judged with (a collector
    judging with others reads those runs itself). ``rows``: every row (a plain tally is
    cheaper over every run with times less the others', `plain_cells`, than over ``plain``'s
    predicate); ``rolled``: the rollups of every row, None when only some rows are read."""

    plain: pl.LazyFrame
    drains: Mapping[str, list[HealthDrain]]
    grace_s: float
    rows: pl.LazyFrame
    rest: pl.DataFrame
    rolled: pl.LazyFrame | None = None

    def others(self, where: pl.Expr | pl.Series | None = None) -> Iterator[list[AcctJob]]:
        """The others' rows (those ``where`` keeps) as records, a batch at a time: a year
        holds millions, and only a batch of them is held as objects at once."""
        rest = self.rest if where is None else self.rest.filter(where)
        return schema.batches(rest.drop("rid"))

    def plain_cells(self) -> pl.DataFrame:
        """``plain`` per outcome cell (day: end // 86400, partition, state, gpus): runs_,
        secs, sorted by the keys; cells with no plain run left out."""
        end = pl.col("end_time")
        keys = ((end // rollup.DAY_S).alias("day"), pl.col("partition"), pl.col("state"),
                pl.col("gpus"))

        def grouped(lf: pl.LazyFrame) -> pl.LazyFrame:
            return lf.group_by(*keys).agg(pl.len().alias("runs_"), SECS.sum())

        every = (rollup.cells(self.rolled) if self.rolled is not None
                 else grouped(self.rows.filter(_timed))).collect(engine="streaming")
        keyed, summed = every.columns[:len(keys)], every.columns[len(keys):]
        off = grouped(self.rest.lazy().filter(_timed)).collect()
        got = (every.join(off, on=keyed, how="left", suffix="_off", nulls_equal=True)
               .select(*keyed, *[pl.col(c) - pl.col(f"{c}_off").fill_null(0) for c in summed])
               .filter(pl.col("runs_") > 0))
        return got.sort(got.columns[:len(keys)])


def rolled(files: Sequence[str], rollups: Sequence[str],
           since: float | None = None) -> pl.LazyFrame:
    """The rollups of the store's runs (``files``, their ``rollups``: `snapshot.Snapshot`'s)
    as one frame; with ``since``, of the runs that ended at or after it: a file of a day that
    starts then or later by its rollup, the others' runs rolled up here (their row groups of
    earlier runs skipped by their statistics)."""
    if since is None:
        return rollup.summed(list(rollups)).lazy()
    whole: list[tuple[str, str]] = []
    part: list[tuple[str, str]] = []
    for f, r in zip(files, rollups, strict=True):
        m = _DAY.search(f)
        begins = (datetime.strptime(m.group(1), "%Y-%m-%d").replace(tzinfo=UTC).timestamp()
                  if m else None)
        (whole if begins is not None and begins >= since else part).append((f, r))
    parts = [rollup.summed([r for _, r in whole]).lazy()]
    if part:
        parts.append(rollup.of(rows([f for f, _ in part], since).drop("rid").collect()).lazy())
    return pl.concat(parts)


_DAY = re.compile(r"/day=(\d{4}-\d{2}-\d{2})/[^/]+$")


def rows(paths: Sequence[str], since: float | None = None, first: int = 0) -> pl.LazyFrame:
    """Every row of the store files ``paths`` (`snapshot.Snapshot.files`: vetted), in ingest
    order (``since``: only runs that ended at or after it; ``first``: the first row's
    ``rid``, for a piece of the files, `pieces`)."""
    if not paths:
        return schema.SCHEMA.to_frame().lazy().with_row_index("rid", offset=first)
    # glob False: a store under a name with [ * ? is that name, not a pattern (that matched
    # nothing, and read as an empty store, or another directory).
    lf = pl.scan_parquet(list(paths), schema=schema.SCHEMA, hive_partitioning=False, glob=False)
    lf = lf.with_row_index("rid", offset=first)
    if since is not None:
        lf = lf.filter(pl.col("end_time") >= since)
    return lf


def count(lf: pl.LazyFrame) -> int:
    return int(lf.select(pl.len()).collect().item())


def _drain_frame(drains: Mapping[str, list[HealthDrain]]) -> pl.DataFrame:
    """(node, at) of every health drain: made once per read, by column (a year's drains as
    row tuples, made again for each piece of `_rest`, were 2 s of its read)."""
    return pl.DataFrame({"node": [n for n, ds in drains.items() for _ in ds],
                         "at": [d.at for ds in drains.values() for d in ds]},
                        schema={"node": pl.String, "at": pl.Float64})


_one_node = ~pl.col("nodes").str.contains(r"[\[,]") & ~pl.col("nodes").is_in(NO_NODES)
_timed = rollup.TIMED


def _drained(rows: pl.LazyFrame, drains: pl.DataFrame, grace_s: float) -> pl.Series:
    """The ``rid`` of each one-node FAILED run of ``rows`` a health drain of its node
    (``drains``: `_drain_frame`'s) may explain (rule 4: a drain while it ran or within the
    grace after): the few such runs that are not plain."""
    if not drains.height:
        return pl.Series("rid", [], dtype=rows.collect_schema()["rid"])
    return (rows.filter(_timed & (pl.col("state") == "FAILED") & _one_node)
            .select("rid", "nodes", "start_time", "end_time")
            .join(drains.lazy(), left_on="nodes", right_on="node")
            .filter((pl.col("at") >= pl.col("start_time"))
                    & (pl.col("at") <= pl.col("end_time") + grace_s))
            .select("rid").unique().collect(engine="streaming").get_column("rid"))


SLICE = 4_000_000  # rows read at once for `_rest` (a file more is one piece of its own)


def pieces(paths: Sequence[str], since: float | None = None) -> list[pl.LazyFrame]:
    """`rows` of ``paths`` in consecutive pieces of whole files, each of at most `SLICE` rows
    (or one file), their ``rid`` those of `rows`: what `_rest` reads a piece at a time."""
    if not paths:
        return [rows(paths, since)]
    out: list[pl.LazyFrame] = []
    at = 0
    group: list[str] = []
    held = 0
    for path in paths:
        n = int(pl.scan_parquet(path, schema=schema.SCHEMA, hive_partitioning=False,
                                glob=False)
                .select(pl.len()).collect().item())  # the file's metadata only
        if group and held + n > SLICE:
            out.append(rows(group, since, at))
            at += held
            group, held = [], 0
        group.append(path)
        held += n
    out.append(rows(group, since, at))
    return out


def _rest(parts: Sequence[pl.LazyFrame], odd: pl.Series,
          drains: Mapping[str, list[HealthDrain]], grace_s: float
          ) -> tuple[pl.DataFrame, pl.Series]:
    """The rows of ``parts`` (`pieces`, or the whole of `rows`) that are not plain (`_plain`:
    not timed, or a state a rule may blame and not a one-node FAILED run no drain explains;
    or a node list in ``odd``), with ``rid`` and the columns `schema.READ`, in store order; and
    `_drained`'s rids.

    Read in one pass, a piece at a time: the rows that may not be plain (a twentieth of them)
    with their columns, the plain ones among them left out in memory. Reading the rest and
    the drained runs each over every row took two passes, and their predicates (a node
    list's shape) were worked out for all of them; the plain one-node FAILED runs are left
    out piece by piece (5.3 of a year's 6.3 million failed runs: read all at once first, they
    held 1.2 GiB)."""
    nodes = pl.col("nodes")
    maybe = ~_timed | pl.col("state").is_in(BLAMABLE) | nodes.is_in(odd.implode())
    rests: list[pl.DataFrame] = []
    drained: list[pl.Series] = []
    frame = _drain_frame(drains)
    for part in parts:
        some = part.filter(maybe).select("rid", *schema.READ).collect(engine="streaming")
        out = _drained(some.lazy(), frame, grace_s)
        rests.append(some.filter(~_kept(out, odd)))
        drained.append(out)
    return pl.concat(rests).sort("rid"), pl.concat(drained)


def _kept(drained: pl.Series, odd: pl.Series) -> pl.Expr:
    """The plain runs (`_plain`) whose node list is not one of ``odd``: tallied on columns."""
    return _plain(drained) & ~pl.col("nodes").is_in(odd.implode())


def _plain(drained: pl.Series) -> pl.Expr:
    """Runs no rule blames, before the node lists are checked (`attribute`): a predicate on
    the store's rows; ``drained``: `_drained`'s."""
    state = pl.col("state")
    return _timed & (~state.is_in(BLAMABLE) | ((state == "FAILED") & _one_node)) \
        & ~pl.col("rid").is_in(drained.implode())


def _by_source(lf: pl.LazyFrame, odd: pl.Series, rolled: pl.LazyFrame | None) -> pl.DataFrame:
    """Node-seconds per (user, submit line) of the runs with times and a node list not in
    ``odd``: the sources' shares of the fleet's runs (`Incidence.user_share`). Each run's
    ``num_nodes`` stands for its list's node count, summed by source alone (grouping on the
    node list too was a third of the read): the caller checks it is that count, else reads
    `_by_source_listed`. The odd lists' runs, few, are taken off after."""
    who = (pl.col("user").fill_null(""), pl.col("submit_line").fill_null(""))
    node_secs = (SECS * pl.col("num_nodes").cast(pl.Int64)).sum().alias("node_secs")
    got = (rollup.sources(rolled) if rolled is not None
           else lf.filter(_timed).group_by(*who).agg(node_secs, pl.len())
           ).collect(engine="streaming")
    if odd.len():
        off = (lf.filter(_timed & pl.col("nodes").is_in(odd.implode())).group_by(*who)
               .agg(node_secs, pl.len()).collect(engine="streaming"))
        got = (got.join(off, on=["user", "submit_line"], how="left", suffix="_off")
               .filter(pl.col("len") > pl.col("len_off").fill_null(0))  # a source left
               .select("user", "submit_line", "len", pl.col("node_secs")
                       - pl.col("node_secs_off").fill_null(0)))
    return got.drop("len").sort("user", "submit_line")


def _by_source_listed(lf: pl.LazyFrame, odd: pl.Series, counts: pl.DataFrame) -> pl.DataFrame:
    """`_by_source` where ``num_nodes`` is not every list's node count: by node list too."""
    who = (pl.col("user").fill_null(""), pl.col("submit_line").fill_null(""))
    return (lf.filter(_timed & ~pl.col("nodes").is_in(odd.implode()))
            .select("nodes", "user", "submit_line", SECS)
            .join(counts.lazy(), on="nodes")
            .group_by(*who).agg((pl.col("secs") * pl.col("n")).sum().alias("node_secs"))
            .sort("user", "submit_line").collect(engine="streaming"))


def _lists(groups: pl.DataFrame, clears: Mapping[str, float]
           ) -> tuple[pl.Series, pl.DataFrame, pl.DataFrame]:
    """The node lists of ``groups`` (`attribute`'s) on columns (`nodelists`): (the odd ones:
    not read there, or naming a node whose lemon drain was cleared, whose runs go one by one;
    per other list its runs, run-seconds, least and most ``num_nodes``, names ``n`` and size
    bucket; the other lists' ranges)."""
    counts, rs = nodelists.ranges(groups.get_column("nodes"))
    if clears:
        cleared = nodelists.naming(rs, clears)
        counts = counts.filter(~pl.col("nodes").is_in(cleared.implode()))
        rs = rs.filter(~pl.col("nodes").is_in(cleared.implode()))
    texts = groups.get_column("nodes").unique()
    odd = texts.filter(~texts.is_in(counts.get_column("nodes").implode())).sort()
    sizes = {n: size_bucket(n) for n in counts.get_column("n").unique().to_list()}
    by_list = (groups.filter(~pl.col("nodes").is_in(odd.implode())).group_by("nodes")
               .agg(pl.col("runs").sum(), pl.col("secs").sum(), pl.col("nn_lo").min(),
                    pl.col("nn_hi").max())
               .join(counts, on="nodes")
               .with_columns(pl.col("n").replace_strict(sizes, return_dtype=pl.Int64)
                             .alias("size")))
    return odd, by_list, rs


def attribute(lf: pl.LazyFrame, att: Attribution, drains: Mapping[str, list[HealthDrain]],
              failures: Mapping[str, list[HealthDrain]], clears: Mapping[str, float],
              grace_s: float, tally: RangeTally,
              rolled: pl.LazyFrame | None = None,
              collect: Callable[[StoreRuns], Others] | None = None,
              parts: Sequence[pl.LazyFrame] = ()) -> StoreRuns:
    """The store's runs into ``att`` (rules 1-4, 6, 7; `add_lone_drains` is the caller's),
    their exposure into ``tally``. Returns what a collector reads.

    The exposure of every run with times and a node list `shape` reads (no cleared node,
    `counted.countable`), failed or not, is tallied on columns; the failed ones are then
    judged by `counted.Judge`, the rest one by one (`attribute_runs`'s per-record rules).
    ``rolled``: the rollups of every row of ``lf`` (`rolled`), whose groups are summed
    rather than made over the rows. ``collect``: a collector's (`history.Collector.add_store`),
    given what it reads before the runs are judged one by one, and their batches then.
    ``parts``: ``lf`` in `pieces`, read a piece at a time for the runs that are not plain."""
    start, end, nodes = (pl.col(c) for c in ("start_time", "end_time", "nodes"))
    groups = (rollup.lists(rolled) if rolled is not None else
              lf.filter(_timed).group_by("nodes", "gpus")
              .agg(pl.len().alias("runs"), SECS.sum(), start.min().alias("lo"),
                   end.min().alias("first_end"), end.max().alias("hi"),
                   pl.col("num_nodes").min().alias("nn_lo"),
                   pl.col("num_nodes").max().alias("nn_hi"))
              ).collect(engine="streaming")
    odd, by_list, rs = _lists(groups, clears)
    rest, drained = _rest(parts or [lf], odd, drains, grace_s)
    keep = _kept(drained, odd)
    groups = groups.filter(~nodes.is_in(odd.implode()))
    by_count = by_list.height == 0 or bool(by_list.select(
        ((pl.col("nn_lo") == pl.col("n")) & (pl.col("nn_hi") == pl.col("n"))).all()).item())
    # The sources' hours are the incidence's: not read for an Attribution that keeps none.
    sources = (pl.DataFrame(schema={"user": pl.String, "submit_line": pl.String,
                                    "node_secs": pl.Int64})
               if att.blames_on is not None else _by_source(lf, odd, rolled) if by_count
               else _by_source_listed(lf, odd, by_list.select("nodes", "n")))
    by_gpus = groups.group_by("gpus").agg(pl.col("runs").sum(), pl.col("secs").sum()).sort("gpus")
    by_size = (by_list.group_by("size").agg((pl.col("n") * pl.col("runs")).sum().alias("node_runs"),
                                            pl.col("secs").sum()).sort("size"))
    add_plain_groups(att, (), ((g, (r, s)) for g, r, s in by_gpus.iter_rows()), tally,
                     (((u, line), secs) for u, line, secs in sources.iter_rows()))
    add_plain_sizes(att, by_size.iter_rows())
    add_exposure(att.exposure, nodelists.spread(
        rs, by_list.select("nodes", "size", "runs", "secs")).iter_rows())
    if groups.height:
        lo, first_end, hi = groups.select(pl.col("lo").min(), pl.col("first_end").min(),
                                          pl.col("hi").max()).row(0)
        att.first_start = min(att.first_start, lo)
        att.first_end = min(att.first_end, first_end)
        att.last_end = max(att.last_end, hi)
    counted = (_timed & ~nodes.is_in(odd.implode())).fill_null(False)  # the rest's: failed
    flags = rest.select(counted).to_series()
    runs = StoreRuns(lf.filter(keep), drains, grace_s, lf, rest, rolled)
    others = collect(runs) if collect is not None else None
    attribute_rest(att, _with_flags(schema.row_batches(rest.drop("rid")), flags, others), drains,
                   failures, clears, grace_s, tally)
    if others is not None:
        others.close()
    judged = int(flags.sum())
    log.debug("store: %d node lists tallied on columns, %d failed runs judged by node list, "
              "%d runs one by one", by_list.height, judged, rest.height - judged)
    return runs


class Others(Protocol):
    """What takes the others' rows (`StoreRuns.rest`) besides the attribution: each batch
    as the attribution reads it, in store order (its columns made lists once, for both), then
    `close`."""

    def take(self, batch: schema.Batch, at: int) -> None: ...
    def close(self) -> None: ...


def _with_flags(batches: Iterable[schema.Batch], flags: pl.Series,
                others: Others | None) -> Iterator[tuple[schema.Batch, list[bool]]]:
    """Each batch with its part of ``flags`` (one per row, in order), given to ``others``
    too."""
    at = 0
    for batch in batches:
        if others is not None:
            others.take(batch, at)
        yield batch, flags.slice(at, len(batch)).to_list()
        at += len(batch)
