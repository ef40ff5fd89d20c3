"""The store's node lists on columns (`store.nodelists`) read the lists `hostranges.shape`
reads and no others, spread runs over their names as `RangeTally` does, and find the lists that
name a node as `hostlist.expand`'s names would."""

from __future__ import annotations

import re

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.store.nodelists import naming, ranges, spread
from gpuwarden.slurm.hostranges import names, shape

number = st.one_of(st.integers(0, 120).map(str), st.integers(0, 120).map(lambda i: f"{i:04d}"),
                   st.integers(0, 120).map(lambda i: f"{i:02d}"),
                   st.sampled_from(["", "007", "9" * 19, "x"]))
item = st.one_of(number, st.tuples(number, number).map("-".join),
                 st.sampled_from(["1-2-3", "5-", "-4"]))
bracketed = st.tuples(st.sampled_from(["n", "n0", "gpu-", "", "a.b_c"]),
                      st.lists(item, min_size=1, max_size=4).map(",".join),
                      st.sampled_from(["", "-ib", "x"])).map(lambda t: f"{t[0]}[{t[1]}]{t[2]}")
odd = st.sampled_from(["n1,n2", "n[1-2]m[3]", "None assigned", "", "(null)", "n[]", "n[1-2",
                       "n[0-1000000]", "node007", "n 1", "n9999999999999999999", "n0042",
                       "n007", "n5"])
lists = st.lists(st.one_of(bracketed, odd), min_size=1, max_size=12)
CAP = 500


def _read(texts: list[str]) -> dict[str, tuple[str, ...]]:
    """What `hostranges` reads of ``texts`` (at most CAP names), by list."""
    out = {}
    for t in set(texts):
        if re.search(r"\[[^]]*[0-9]{19}", t):
            continue  # a number past an Int64's digits: left to the per-record way
        known = shape(t)
        if known is not None and known[1] <= CAP:
            out[t] = names(known[0])
    return out


@settings(max_examples=100, deadline=None)
@given(lists, st.lists(st.integers(1, 9), min_size=12, max_size=12),
       st.lists(st.sampled_from(["n0042", "n42", "n007", "n7", "gpu-05x", "n5", "n00"]),
                max_size=3))
def test_lists_read_spread_and_named_as_hostranges_does(texts: list[str], runs: list[int],
                                                        wanted: list[str]) -> None:
    counts, rs = ranges(pl.Series(texts, dtype=pl.String), cap=CAP)
    want = _read(texts)
    assert dict(counts.iter_rows()) == {t: len(v) for t, v in want.items()}
    assert set(rs.get_column("nodes")) == set(want)

    per_list = sorted(want)
    tally = RangeTally()
    for i, t in enumerate(per_list):
        known = shape(t)
        assert known is not None
        tally.add(known[0], 2 + i % 3, 100 * runs[i], runs[i])
    frame = pl.DataFrame({"nodes": per_list, "size": [2 + i % 3 for i in range(len(per_list))],
                          "runs": runs[:len(per_list)],
                          "secs": [100 * r for r in runs[:len(per_list)]]},
                         schema={"nodes": pl.String, "size": pl.Int64, "runs": pl.Int64,
                                 "secs": pl.Int64})
    # Summed per node and size, as `add_exposure` sums them (n[1,0-1] names n1 twice, under
    # two widths).
    spread_here: dict[tuple[str, int], tuple[int, int]] = {}
    for n, size, r, s in tally.spread():
        had = spread_here.get((n, size), (0, 0))
        spread_here[(n, size)] = (had[0] + r, had[1] + s)
    assert sorted(spread(rs, frame).iter_rows()) == sorted(
        (n, size, r, s) for (n, size), (r, s) in spread_here.items())

    assert naming(rs, wanted).to_list() == sorted(
        t for t, ns in want.items() if set(ns) & set(wanted))


def test_a_range_too_long_for_expand_is_left_out() -> None:
    counts, rs = ranges(pl.Series(["n[1-1000000]", "n[1-3]"]), cap=2)
    assert counts.rows() == [] and rs.is_empty()
    counts, rs = ranges(pl.Series(["n[0001-0003]", "n[1-1000001]"]))
    assert counts.rows() == [("n[0001-0003]", 3)]
