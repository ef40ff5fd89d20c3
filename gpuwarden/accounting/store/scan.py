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
(tests/unit/test_acct_store_golden.py, test_attribution_counted.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import polars as pl

from gpuwarden.accounting.attribution import (
    Attribution,
    HealthDrain,
    add_plain_groups,
    meets_cleared,
)
from gpuwarden.accounting.columns import Columns
from gpuwarden.accounting.counted import attribute_rest, countable
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.store import schema
from gpuwarden.slurm.hostranges import shape
from gpuwarden.slurm.models import AcctJob

log = logging.getLogger(__name__)

BLAMABLE = ("NODE_FAIL", "BOOT_FAIL", "REQUEUED", "FAILED")
NO_NODES = ("", "None assigned", "(null)")
SECS = pl.max_horizontal(pl.col("end_time") - pl.col("start_time"), pl.lit(1)).alias("secs")


@dataclass(frozen=True)
class StoreRuns:
    """What a collector (`history.Collector.add_store`) reads of the store: the plain runs
    as a LazyFrame of store rows, the others as records (in store order, also given to the
    attribution), and the health drains and grace the one-node FAILED runs in ``plain`` were
    judged with (a collector judging with others reads those runs itself)."""

    plain: pl.LazyFrame
    others: list[AcctJob]
    drains: Mapping[str, list[HealthDrain]]
    grace_s: float


def rows(paths: Sequence[str], since: float | None = None) -> pl.LazyFrame:
    """Every row of the store files ``paths`` (`snapshot.Snapshot.files`: vetted), in ingest
    order (``since``: only runs that ended at or after it)."""
    if not paths:
        return schema.SCHEMA.to_frame().lazy().with_row_index("rid")
    lf = pl.scan_parquet(list(paths), schema=schema.SCHEMA, hive_partitioning=False)
    lf = lf.with_row_index("rid")
    if since is not None:
        lf = lf.filter(pl.col("end_time") >= since)
    return lf


def count(lf: pl.LazyFrame) -> int:
    return int(lf.select(pl.len()).collect().item())


def _drain_frame(drains: Mapping[str, list[HealthDrain]]) -> pl.LazyFrame:
    pairs = [(n, d.at) for n, ds in drains.items() for d in ds]
    return pl.DataFrame(pairs, schema={"node": pl.String, "at": pl.Float64},
                        orient="row").lazy()


def _plain(lf: pl.LazyFrame, drains: Mapping[str, list[HealthDrain]],
           grace_s: float) -> pl.Expr:
    """Runs no rule blames, before the node lists are checked (`attribute`): a predicate on
    the store's rows (the one-node FAILED runs a health drain of the node may explain, rule 4,
    are found first: they are few)."""
    start, end, state, nodes = (pl.col(c) for c in ("start_time", "end_time", "state", "nodes"))
    timed = start.is_not_null() & end.is_not_null() & (end >= start)
    one = (state == "FAILED") & ~nodes.str.contains(r"[\[,]") & ~nodes.is_in(NO_NODES)
    drained = (lf.filter(timed & one).select("rid", "nodes", "start_time", "end_time")
               .join(_drain_frame(drains), left_on="nodes", right_on="node")
               .filter((pl.col("at") >= pl.col("start_time"))
                       & (pl.col("at") <= pl.col("end_time") + grace_s))
               .select("rid").unique().collect().get_column("rid"))
    return timed & (~state.is_in(BLAMABLE) | one) & ~pl.col("rid").is_in(drained.implode())


def _odd(texts: Sequence[str], clears: Mapping[str, float]) -> list[str]:
    """Node lists `shape` does not read, or that name a node with a cleared lemon drain."""
    return [t for t in texts
            if not t or shape(t) is None or (clears and meets_cleared(t, clears))]


def _count(text: str) -> int:
    known = shape(text)
    assert known is not None, text  # `_odd` left only lists shape reads
    return known[1]


def _by_source(counted: pl.LazyFrame, counts: pl.DataFrame, by_count: bool) -> pl.DataFrame:
    """Node-seconds of the counted runs per (user, submit line): the sources' shares of the
    fleet's runs (`Incidence.user_share`). ``by_count``: every run's ``num_nodes`` is its
    list's node count (``counts``, checked by the caller), so the runs are summed by source
    alone, without grouping on the node list too (a third of the read at 1M records)."""
    who = (pl.col("user").fill_null(""), pl.col("submit_line").fill_null(""))
    if by_count:
        got = counted.group_by(*who).agg(
            (SECS * pl.col("num_nodes").cast(pl.Int64)).sum().alias("node_secs"))
    else:
        got = (counted.select("nodes", "user", "submit_line", SECS)
               .join(counts.lazy(), on="nodes")
               .group_by(*who).agg((pl.col("secs") * pl.col("n")).sum().alias("node_secs")))
    return got.sort("user", "submit_line").collect(engine="streaming")


def attribute(lf: pl.LazyFrame, att: Attribution, drains: Mapping[str, list[HealthDrain]],
              failures: Mapping[str, list[HealthDrain]], clears: Mapping[str, float],
              grace_s: float, tally: RangeTally) -> StoreRuns:
    """The store's runs into ``att`` (rules 1-4, 6, 7; `add_lone_drains` is the caller's),
    their exposure into ``tally``. Returns what a collector reads.

    The exposure of the plain runs and of the failed runs with a node list `shape` reads (no
    cleared node, `counted.countable`) is tallied on columns; those failed runs are then
    judged by `counted.Judge`, the rest one by one (`attribute_runs`'s per-record rules)."""
    keep = _plain(lf, drains, grace_s)
    start, end = pl.col("start_time"), pl.col("end_time")
    timed = start.is_not_null() & end.is_not_null() & (end >= start)
    failed = timed & ~keep  # a state rules 1-4 may blame (`_plain`)
    groups = (lf.filter(timed).group_by("nodes", "gpus", failed.alias("failed"))
              .agg(pl.len().alias("runs"), SECS.sum(), start.min().alias("lo"),
                   end.min().alias("first_end"), end.max().alias("hi"),
                   pl.col("num_nodes").min().alias("nn_lo"),
                   pl.col("num_nodes").max().alias("nn_hi"))
              .collect(engine="streaming"))
    texts = groups.group_by("failed").agg(pl.col("nodes").unique())
    listed = {f: ts for f, ts in texts.iter_rows()}
    odd = pl.Series(_odd(listed.get(False, []), clears), dtype=pl.String)
    failed_texts = listed.get(True, [])
    odd_failed = pl.Series(list(set(_odd(failed_texts, clears))
                                | {t for t in failed_texts if not countable(t)}),
                           dtype=pl.String)
    nodes = pl.col("nodes")
    counted_f = failed & ~nodes.is_in(odd_failed.implode())
    keep &= ~nodes.is_in(odd.implode())
    groups = groups.filter(pl.when(pl.col("failed")).then(~nodes.is_in(odd_failed.implode()))
                           .otherwise(~nodes.is_in(odd.implode())))
    by_list = (groups.group_by("nodes").agg(pl.col("runs").sum(), pl.col("secs").sum(),
                                            pl.col("nn_lo").min(), pl.col("nn_hi").max())
               .sort("nodes"))
    by_list = by_list.with_columns(pl.Series("n", [_count(t) for t in by_list["nodes"]],
                                             dtype=pl.Int64))
    by_count = by_list.height == 0 or bool(by_list.select(
        ((pl.col("nn_lo") == pl.col("n")) & (pl.col("nn_hi") == pl.col("n"))).all()).item())
    by_gpus = groups.group_by("gpus").agg(pl.col("runs").sum(), pl.col("secs").sum()).sort("gpus")
    add_plain_groups(att, ((t, (r, s, n)) for t, r, s, n in
                           by_list.select("nodes", "runs", "secs", "n").iter_rows()),
                     ((g, (r, s)) for g, r, s in by_gpus.iter_rows()), tally,
                     (((u, line), secs) for u, line, secs
                      in _by_source(lf.filter(keep | counted_f), by_list.select("nodes", "n"),
                                    by_count).iter_rows()))
    if groups.height:
        lo, first_end, hi = groups.select(pl.col("lo").min(), pl.col("first_end").min(),
                                          pl.col("hi").max()).row(0)
        att.first_start = min(att.first_start, lo)
        att.first_end = min(att.first_end, first_end)
        att.last_end = max(att.last_end, hi)
    rest = (lf.filter(~keep).with_columns(counted_f.fill_null(False).alias("counted"))
            .sort("rid").drop("rid").collect(engine="streaming"))
    others = schema.jobs(rest.drop("counted"))
    attribute_rest(att, Columns(others), rest.get_column("counted").to_list(), drains,
                   failures, clears, grace_s, tally)
    log.debug("store: %d node lists tallied on columns, %d runs one by one, %d failed runs "
              "judged by node list", by_list.height, len(others) - int(rest["counted"].sum()),
              int(rest["counted"].sum()))
    return StoreRuns(lf.filter(keep), others, drains, grace_s)
