"""The store read back for the attribution and the report's tally, on columns (polars).

Most runs are ones no rule can blame on a node: a state never blamed (COMPLETED, TIMEOUT...),
or a one-node FAILED run with no health drain of its node while it ran or within the grace
after (rule 4: the user's). Those ("plain") are tallied by group in polars: runs and
run-seconds per node list and per GPU count for the attribution (`add_plain_groups`), per
(day, partition, state, GPUs) for the report (`RunTally.add_store`). The rest (failed runs an
event or a gang may explain, node lists of another shape, nodes whose lemon drain was cleared,
runs without times) are read as records, in store order, and go through the same per-record
rules as an export's (`attribute_runs`), so both paths give the same figures
(tests/unit/test_acct_store_golden.py).
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
    attribute_runs,
    meets_cleared,
)
from gpuwarden.accounting.columns import Columns
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


def _by_source(plain: pl.LazyFrame, counts: pl.DataFrame) -> pl.DataFrame:
    """Node-seconds of the plain runs per (user, submit line): the sources' shares of the
    fleet's runs (`Incidence.user_share`)."""
    return (plain.group_by("nodes", "user", "submit_line").agg(SECS.sum())
            .join(counts.lazy(), on="nodes")
            .group_by(pl.col("user").fill_null(""), pl.col("submit_line").fill_null(""))
            .agg((pl.col("secs") * pl.col("n")).sum().alias("node_secs"))
            .sort("user", "submit_line")
            .collect(engine="streaming"))


def attribute(lf: pl.LazyFrame, att: Attribution, drains: Mapping[str, list[HealthDrain]],
              failures: Mapping[str, list[HealthDrain]], clears: Mapping[str, float],
              grace_s: float, tally: RangeTally) -> StoreRuns:
    """The store's runs into ``att`` (rules 1-4, 6, 7; `add_lone_drains` is the caller's),
    their exposure into ``tally``. Returns what a collector reads."""
    keep = _plain(lf, drains, grace_s)
    groups = (lf.filter(keep).group_by("nodes", "gpus")
              .agg(pl.len().alias("runs"), SECS.sum(), pl.col("start_time").min().alias("lo"),
                   pl.col("end_time").min().alias("first_end"),
                   pl.col("end_time").max().alias("hi"))
              .collect(engine="streaming"))
    odd = _odd(groups.get_column("nodes").unique().to_list(), clears)
    if odd:
        groups = groups.filter(~pl.col("nodes").is_in(odd))
        keep &= ~pl.col("nodes").is_in(pl.Series(odd, dtype=pl.String).implode())
    plain = lf.filter(keep)
    by_list = (groups.group_by("nodes").agg(pl.col("runs").sum(), pl.col("secs").sum())
               .sort("nodes"))
    by_list = by_list.with_columns(pl.Series("n", [_count(t) for t in by_list["nodes"]],
                                             dtype=pl.Int64))
    by_gpus = groups.group_by("gpus").agg(pl.col("runs").sum(), pl.col("secs").sum()).sort("gpus")
    add_plain_groups(att, ((t, (r, s, n)) for t, r, s, n in by_list.iter_rows()),
                     ((g, (r, s)) for g, r, s in by_gpus.iter_rows()), tally,
                     (((u, line), secs) for u, line, secs
                      in _by_source(plain, by_list.select("nodes", "n")).iter_rows()))
    if groups.height:
        lo, first_end, hi = groups.select(pl.col("lo").min(), pl.col("first_end").min(),
                                          pl.col("hi").max()).row(0)
        att.first_start = min(att.first_start, lo)
        att.first_end = min(att.first_end, first_end)
        att.last_end = max(att.last_end, hi)
    rest = lf.filter(~keep).sort("rid").drop("rid").collect(engine="streaming")
    others = schema.jobs(rest)
    attribute_runs(Columns(others), drains, grace_s, clears, failures, into=att, tally=tally)
    log.debug("store: %d node lists tallied on columns, %d runs one by one", by_list.height,
              len(others))
    return StoreRuns(plain, others, drains, grace_s)
