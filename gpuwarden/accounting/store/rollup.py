"""Rollups: each runs file's runs summed by group, written beside it at ingest and summed again
at read, as `sreport` reads slurmdbd's rollup tables rather than every job. Pure.

Every group-by the readers make over every stored run (the attribution's exposure per node
list and GPU count, the sources' node-seconds, the report's outcome cells) is of sums, least
and most, so each can be made per file once and summed over the files: at 10 million stored
runs, a day's 333k rows hold about 80k node lists, 100 sources and 40 cells. One table per
runs file, the three grains stacked (``grain``), over the runs with start and end times
(`TIMED`); the reads that need rows still read the runs files (`store.scan`).
"""

from __future__ import annotations

import polars as pl

TIMED = (pl.col("start_time").is_not_null() & pl.col("end_time").is_not_null()
         & (pl.col("end_time") >= pl.col("start_time")))
SECS = pl.max_horizontal(pl.col("end_time") - pl.col("start_time"), pl.lit(1)).alias("secs")
DAY_S = 86_400

LISTS, SOURCES, CELLS = "lists", "sources", "cells"
SCHEMA = pl.Schema({
    "grain": pl.String,  # lists | sources | cells
    "nodes": pl.String, "gpus": pl.Int32,  # lists, cells (gpus)
    "user": pl.String, "submit_line": pl.String,  # sources ("" for none)
    "day": pl.Int64, "partition": pl.String, "state": pl.String,  # cells (day: end // 86400)
    "runs": pl.Int64, "secs": pl.Int64,  # every grain (secs: sources none)
    "node_secs": pl.Int64,  # sources: run-seconds x num_nodes
    "lo": pl.Int64, "first_end": pl.Int64, "hi": pl.Int64,  # lists: least start, end; most end
    "nn_lo": pl.Int32, "nn_hi": pl.Int32,  # lists: least and most num_nodes
})
MEANING = {
    "grain": "which group the row sums: `lists` (per node list and GPU count), `sources` (per "
             "user and submit line), `cells` (per UTC day of the end, partition, state, GPUs)",
    "runs": "runs in the group (only runs with start and end times are rolled up)",
    "secs": "their run-seconds, each at least 1 (lists, cells)",
    "node_secs": "their run-seconds times num_nodes (sources)",
    "lo / first_end / hi": "the least start, the least end, the most end (lists)",
    "nn_lo / nn_hi": "the least and most num_nodes (lists)",
}


def of(df: pl.DataFrame) -> pl.DataFrame:
    """The rollup of ``df`` (rows of the store)."""
    timed = df.lazy().filter(TIMED)
    start, end = pl.col("start_time"), pl.col("end_time")
    lists = timed.group_by("nodes", "gpus").agg(
        pl.len().alias("runs"), SECS.sum(), start.min().alias("lo"),
        end.min().alias("first_end"), end.max().alias("hi"),
        pl.col("num_nodes").min().alias("nn_lo"), pl.col("num_nodes").max().alias("nn_hi"))
    sources = timed.group_by(pl.col("user").fill_null(""),
                             pl.col("submit_line").fill_null("")).agg(
        pl.len().alias("runs"),
        (SECS * pl.col("num_nodes").cast(pl.Int64)).sum().alias("node_secs"))
    cells = timed.group_by((end // DAY_S).alias("day"), "partition", "state", "gpus").agg(
        pl.len().alias("runs"), SECS.sum())
    parts = [lists.with_columns(pl.lit(LISTS).alias("grain")),
             sources.with_columns(pl.lit(SOURCES).alias("grain")),
             cells.with_columns(pl.lit(CELLS).alias("grain"))]
    got = pl.concat(parts, how="diagonal_relaxed").collect()
    return got.select([pl.col(n).cast(t) if n in got.columns else pl.lit(None, t).alias(n)
                       for n, t in SCHEMA.items()])


def scan(paths: list[str]) -> pl.LazyFrame:
    """The rollup files ``paths`` (vetted) as one frame."""
    if not paths:
        return SCHEMA.to_frame().lazy()
    return pl.scan_parquet(paths, schema=SCHEMA, hive_partitioning=False, glob=False)


PER_READ = 30  # rollup files summed at once (`summed`): a month of days


def summed(paths: list[str]) -> pl.DataFrame:
    """The rollup files ``paths`` (vetted) summed again into one rollup, `PER_READ` files at
    a time: one row per group, its sums, least and most the same as over every file's rows.
    Read once for the three grains (each read of a year's 360 files, 29 million rows of node
    lists, held 1.5-2.4 GiB at its peak)."""
    got = SCHEMA.to_frame()
    for at in range(0, len(paths), PER_READ):
        got = _resummed(pl.concat([got.lazy(), scan(paths[at:at + PER_READ])]))
    return got


def _resummed(rolled: pl.LazyFrame) -> pl.DataFrame:
    c = pl.col
    grains = [
        rolled.filter(c("grain") == LISTS).group_by("nodes", "gpus").agg(
            c("runs").sum(), c("secs").sum(), c("lo").min(), c("first_end").min(),
            c("hi").max(), c("nn_lo").min(), c("nn_hi").max()),
        rolled.filter(c("grain") == SOURCES).group_by("user", "submit_line").agg(
            c("runs").sum(), c("node_secs").sum()),
        rolled.filter(c("grain") == CELLS).group_by("day", "partition", "state", "gpus").agg(
            c("runs").sum(), c("secs").sum())]
    got = pl.concat([g.with_columns(pl.lit(name).alias("grain"))
                     for g, name in zip(grains, (LISTS, SOURCES, CELLS), strict=True)],
                    how="diagonal_relaxed").collect(engine="streaming")
    return got.select([pl.col(n).cast(t) if n in got.columns else pl.lit(None, t).alias(n)
                       for n, t in SCHEMA.items()])


def lists(rolled: pl.LazyFrame) -> pl.LazyFrame:
    """Per (nodes, gpus): runs, secs, lo, first_end, hi, nn_lo, nn_hi, as a group-by of
    every timed run gives them."""
    c = pl.col
    return (rolled.filter(c("grain") == LISTS).group_by("nodes", "gpus")
            .agg(c("runs").sum().cast(pl.UInt32), c("secs").sum(), c("lo").min(),
                 c("first_end").min(), c("hi").max(), c("nn_lo").min(), c("nn_hi").max()))


def sources(rolled: pl.LazyFrame) -> pl.LazyFrame:
    """Per (user, submit_line): node_secs, len (runs)."""
    c = pl.col
    return (rolled.filter(c("grain") == SOURCES).group_by("user", "submit_line")
            .agg(c("node_secs").sum(), c("runs").sum().cast(pl.UInt32).alias("len")))


def cells(rolled: pl.LazyFrame) -> pl.LazyFrame:
    """Per (day, partition, state, gpus): runs_, secs."""
    c = pl.col
    return (rolled.filter(c("grain") == CELLS).group_by("day", "partition", "state", "gpus")
            .agg(c("runs").sum().cast(pl.UInt32).alias("runs_"), c("secs").sum()))
