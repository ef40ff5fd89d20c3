"""The failed runs of a fit that share a hazard, found at once. Pure.

A run's hazard is the sum of its counted nodes' rates, plus the background of its job size
where that counts in it. Runs with the same counted nodes (in the same order), the same
background use and, where the background counts, the same size have the same hazard for every
rate, bit for bit (the same sum in the same order), so the EM (`inference._Em`) keeps one row
for each such set and their summed weights.

Rows are grouped by a 64-bit hash of those, then each row is compared with its group's first,
entry by entry: a row a hash collision put in the wrong group keeps a row of its own, so the
grouping is exact whatever the hash does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.incidence import FloatArray, IndexArray, IntArray, index_dtype

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

U64 = npt.NDArray[np.uint64]


def _mix(x: U64) -> U64:
    """splitmix64's finaliser: every input bit moves every output bit (wrapping uint64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    out: U64 = x ^ (x >> np.uint64(31))
    return out



@dataclass(frozen=True, eq=False)
class Distinct:
    reps: IntArray  # per distinct row: the first run of its kind (an incidence row)
    node: IndexArray  # per entry of the distinct rows: the counted node (its run's, in order)
    row: IndexArray  # per such entry: its distinct row (ascending)
    of_run: IntArray  # per incidence row: its distinct row; -1 for rows left out


# Entries hashed and compared per block of about this many: each step over all of them at
# once made several 8-byte temporaries an entry (tens of millions at a year), the scoring's
# peak.
BLOCK = 1 << 21


def _blocks(n: int, row: IndexArray | None = None, start: IntArray | None = None
            ) -> Iterator[tuple[int, int]]:
    """Entry blocks [a, b) of about `BLOCK` entries; given ``row`` and ``start``, each ends
    at the end of a row (a row is never split)."""
    a = 0
    while a < n:
        b = min(a + BLOCK, n)
        if row is not None and start is not None:
            b = int(start[int(row[b - 1]) + 1])
        yield a, b
        a = b


def _row_hashes(node: IndexArray, row: IndexArray, start: IntArray, rows: int) -> U64:
    """Per row, the wrapping sum of its entries' hashes (of node and place in the row); 0 for
    a row without entries. A sum of uint64 wraps alike in any grouping, so by blocks it is
    the sum over all at once, bit for bit."""
    h = np.zeros(rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for a, b in _blocks(len(node), row, start):
            r = row[a:b]
            pos = np.arange(a, b, dtype=np.int64) - start[r]
            h_e = _mix(node[a:b].astype(np.uint64) * _GOLDEN + pos.astype(np.uint64))
            heads = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
            h[r[heads]] = np.add.reduceat(h_e, heads)
    return h


def _unlike(node: IndexArray, row: IndexArray, start: IntArray, length: IntArray,
            e_rep: IntArray, rows: int) -> npt.NDArray[np.bool_]:
    """Per row: some entry differs from the same place of its representative's row
    (``e_rep``), or the lengths differ."""
    bad = np.zeros(rows, dtype=bool)
    for a, b in _blocks(len(node)):
        r = row[a:b]
        r_of = e_rep[r]
        pos = np.arange(a, b, dtype=np.int64) - start[r]
        ok_len = length[r_of] == length[r]
        other = np.where(ok_len, start[r_of] + pos, 0)
        bad[r[~ok_len | (node[other] != node[a:b])]] = True
    return bad


def distinct_rows(node: IndexArray, row: IndexArray, rows: int, size: IntArray,
                  bg_use: FloatArray, take: npt.NDArray[np.bool_]) -> Distinct:
    """``node``, ``row``: the counted entries, by row (ascending); ``size``, ``bg_use``: per
    row; ``take``: per row, whether it is kept (a row left out maps to -1). Distinct rows
    are numbered in the order of their first run."""
    on = take[row]
    if not on.all():
        node, row = node[on], row[on]
    del on
    length = np.bincount(row, minlength=rows)
    start = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(length, out=start[1:])
    bg = bg_use > 0
    h = _row_hashes(node, row, start, rows)
    with np.errstate(over="ignore"):
        tail = (length.astype(np.uint64) << np.uint64(8)) | bg.astype(np.uint64)
        tail = tail ^ (np.where(bg, size, -1).astype(np.uint64) << np.uint64(40))
        h = _mix(h ^ _mix(tail + _GOLDEN))
    kept = np.flatnonzero(take)
    _, first, inv = np.unique(h[kept], return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    rep = kept[first][inv]  # per kept row, the first kept row with its hash
    same = ((length[kept] == length[rep]) & (bg[kept] == bg[rep])
            & (bg_use[kept] == bg_use[rep]) & (~bg[kept] | (size[kept] == size[rep])))
    # Entry by entry against the representative's (same length, so the same positions).
    e_rep = np.full(rows, -1, dtype=np.int64)
    e_rep[kept] = rep
    same &= ~_unlike(node, row, start, length, e_rep, rows)[kept]
    # Numbered by their first runs; a row unlike its representative is a row of its own.
    lead = np.where(same, rep, kept)
    uniq, group = np.unique(lead, return_inverse=True)
    of_run = np.full(rows, -1, dtype=np.int64)
    of_run[kept] = group.reshape(-1)
    reps = uniq.astype(np.int64)
    n = length[reps]
    out_row = np.repeat(np.arange(len(reps), dtype=index_dtype(len(reps))), n)
    base = np.repeat(start[reps] - np.cumsum(n) + n, n)
    idx = base + np.arange(len(out_row), dtype=np.int64)
    return Distinct(reps, node[idx], out_row, of_run)


def every_row(node: IndexArray, row: IndexArray, rows: int, take: npt.NDArray[np.bool_]
              ) -> Distinct:
    """`distinct_rows` with no two rows merged: each kept row its own (the reference the
    merged EM is tested against)."""
    on = take[row]
    kept = np.flatnonzero(take)
    of_run = np.full(rows, -1, dtype=np.int64)
    of_run[kept] = np.arange(len(kept), dtype=np.int64)
    return Distinct(kept.astype(np.int64), node[on], of_run[row[on]], of_run)
