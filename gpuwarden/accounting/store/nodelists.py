"""Node lists on columns: the ranges of every list `hostranges.shape` reads, and the exposure
of runs spread over their names, in polars. Pure.

At 10 million stored runs the distinct node lists number in the hundreds of thousands, and
reading each in Python (its shape, its count, its runs added to a `RangeTally`, spread over
its names) was a third of a read of the store. Here each list is split into its ranges on
columns, with `hostranges`' rules: one name, or one bracket of comma-separated numbers and
ranges with a plain head and tail; a number with a leading zero sets the width of its range's
names. Runs are added to their ranges as differences (+ at a range's first number, - after its
last), summed and spread over the names once, as `RangeTally.spread` does: a list's names are
never made one by one. A list read here names what `hostlist.expand` names
(tests/unit/test_acct_store_nodelists.py holds the two to each other); a list not read here
goes the per-record way, which reads it as it always did.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from gpuwarden.slurm.hostlist import _MAX_EXPAND

_ONE = r"^[A-Za-z0-9._\-]+$"
_BRACKETED = r"^(?P<head>[A-Za-z0-9._\-]*)\[(?P<body>[0-9,\-]+)\](?P<tail>[A-Za-z0-9._\-]*)$"
# Up to 18 digits a number fits an Int64; a longer one (never a real node) leaves its list to
# the per-record way rather than to a cast that could overflow.
_ITEM = r"^(?P<lo>[0-9]{1,18})(?:-(?P<hi>[0-9]{1,18}))?$"
KEY = ("head", "width", "tail")  # a range's names: head, the number zero-padded to width, tail
RANGES = {"nodes": pl.String, "head": pl.String, "width": pl.Int64, "tail": pl.String,
          "first": pl.Int64, "last": pl.Int64}


def ranges(texts: pl.Series, cap: int = _MAX_EXPAND) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``texts``' lists that `hostranges.shape` reads with at most ``cap`` names (what
    `counted.countable` takes): (``counts``: nodes, n (its names); ``ranges``: nodes, head,
    width, tail, first, last, a row per range, a list of one name as a range of width -1
    (the name is the head)). Lists left out of both: not read here."""
    df = pl.DataFrame({"nodes": texts.unique()}, schema={"nodes": pl.String}).drop_nulls()
    nodes = pl.col("nodes")
    one = df.filter(nodes.str.contains(_ONE)).select(
        "nodes", nodes.alias("head"), pl.lit(-1, pl.Int64).alias("width"),
        pl.lit("").alias("tail"), pl.lit(0, pl.Int64).alias("first"),
        pl.lit(0, pl.Int64).alias("last"))
    items = (df.filter(~nodes.str.contains(_ONE))
             .select("nodes", nodes.str.extract_groups(_BRACKETED).alias("m")).unnest("m")
             .drop_nulls("body")
             .with_columns(pl.col("body").str.split(",").alias("item"))
             .explode("item")
             .with_columns(pl.col("item").str.extract_groups(_ITEM).alias("r")).unnest("r"))
    lo, hi = pl.col("lo"), pl.col("hi")
    items = items.select(
        "nodes", "head",
        pl.when(lo.str.starts_with("0")).then(lo.str.len_chars()).otherwise(0)
        .cast(pl.Int64).alias("width"),
        "tail", lo.cast(pl.Int64).alias("first"),
        pl.coalesce(hi, lo).cast(pl.Int64).alias("last"))
    first, last = pl.col("first"), pl.col("last")
    bad = first.is_null() | (last < first) | (last - first >= _MAX_EXPAND)
    read = (items.group_by("nodes")
            .agg(bad.any().alias("bad"), (last - first + 1).sum().alias("n"))
            .filter(~pl.col("bad") & (pl.col("n") <= cap)).select("nodes", "n"))
    counts = pl.concat([one.select("nodes", pl.lit(1, pl.Int64).alias("n")), read])
    kept = items.join(read.select("nodes"), on="nodes", how="semi")
    return counts, pl.concat([one, kept]).cast(RANGES)  # type: ignore[arg-type]


def _name(i: pl.Expr) -> pl.Expr:
    """The name numbered ``i`` in its row's range, as `hostranges.name` writes it."""
    width = pl.col("width")
    return (pl.when(width < 0).then(pl.col("head"))
            .otherwise(pl.concat_str("head", i.cast(pl.String).str.zfill(width.clip(0)),
                                     "tail")))


def naming(rs: pl.DataFrame, names: Iterable[str]) -> pl.Series:
    """The lists of ``rs`` (`ranges`') that hold one of ``names``."""
    wanted = sorted(set(names))
    if not wanted:
        return pl.Series("nodes", [], pl.String)
    # Each way a name can split into head, number and tail, matched to the ranges of that
    # head and tail: a range names it when the number is in it and written at its width.
    splits = [(n, n[:a], n[b:], n[a:b]) for n in wanted for a in range(len(n))
              for b in range(a + 1, min(len(n), a + 18) + 1) if n[a:b].isdigit()]
    cand = pl.DataFrame(splits, schema={"name": pl.String, "head": pl.String, "tail": pl.String,
                                        "digits": pl.String}, orient="row")
    num = pl.col("digits").cast(pl.Int64)
    hits = (rs.filter(pl.col("width") >= 0).join(cand, on=["head", "tail"])
            .filter((num >= pl.col("first")) & (num <= pl.col("last"))
                    & (_name(num) == pl.col("name"))))
    ones = rs.filter((pl.col("width") < 0) & pl.col("head").is_in(wanted))
    return pl.concat([hits.get_column("nodes"), ones.get_column("nodes")]).unique().sort()


def spread(rs: pl.DataFrame, runs: pl.DataFrame) -> pl.DataFrame:
    """(node, size, runs, secs): ``runs`` (nodes, size, runs, secs: per node list) over the
    names of their lists' ranges ``rs`` (`ranges`'), summed per node and size bucket."""
    key = [*KEY, "size"]
    at = pl.col("at")
    edges = rs.join(runs, on="nodes").select(*key, "first", "last",
                                             pl.col("runs", "secs").cast(pl.Int64))
    diff = (pl.concat([edges.select(*key, pl.col("first").alias("at"), "runs", "secs"),
                       edges.select(*key, (pl.col("last") + 1).alias("at"),
                                    -pl.col("runs"), -pl.col("secs"))])
            .group_by(*key, "at").agg(pl.col("runs").sum(), pl.col("secs").sum())
            .sort(*key, "at"))
    level = diff.with_columns(pl.col("runs").cum_sum().over(key),
                              pl.col("secs").cum_sum().over(key),
                              at.shift(-1).over(key).alias("upto"))
    return (level.filter(pl.col("runs") > 0)
            .select(*KEY, "size", "runs", "secs", pl.int_ranges(at, "upto").alias("i"))
            .explode("i")
            .select(_name(pl.col("i")).alias("node"), "size", "runs", "secs")
            .group_by("node", "size").agg(pl.col("runs").sum(), pl.col("secs").sum())
            .sort("node", "size"))
