"""Runs and run-seconds per node, added a hostlist range at a time. Pure.

At fleet scale (10 million runs, ~8 nodes each) expanding every run's node list into names
and touching each node's counters was most of the scan. Here ``n[0100-0163]`` costs one
difference-array update per size bucket, whatever its length; names are made once per node
when the totals are read (`spread`). Node lists of another shape (several brackets, a comma
outside brackets) return None from `hostranges.ranges` and the caller expands them the usual way.
Seconds are summed as integers, so the totals do not depend on the order runs came in.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from itertools import pairwise

from gpuwarden.slurm.hostranges import Key, Range, name, shape

FOLD_AT = 100_000  # distinct node lists held before they are folded into ranges


class RangeTally:
    """Runs and seconds per node list (most runs repeat a list: one node alone, a gang's
    block), folded into differences of run counts and run-seconds per (name pattern, size
    bucket) when many lists are held and when read."""

    def __init__(self) -> None:
        self._lists: dict[str, list[int]] = {}
        self._diff: dict[tuple[Key, int], dict[int, list[int]]] = defaultdict(dict)

    def add_list(self, text: str, size: int, seconds: int, runs: int = 1) -> None:
        """``runs`` runs on ``text``, which `shape` reads, of ``size`` (its size bucket) and
        ``seconds`` in all."""
        t = self._lists.get(text)
        if t is None:
            self._lists[text] = [runs, seconds, size]
            if len(self._lists) >= FOLD_AT:
                self._fold()
        else:
            t[0] += runs
            t[1] += seconds

    def _fold(self) -> None:
        for text, (runs, secs, size) in self._lists.items():
            known = shape(text)
            assert known is not None, text
            self.add(known[0], size, secs, runs)
        self._lists.clear()

    def add(self, rs: tuple[Range, ...], size: int, seconds: int, runs: int = 1) -> None:
        """``runs`` runs on the names of ``rs``, of ``seconds`` in all."""
        for key, lo, hi in rs:
            d = self._diff[(key, size)]
            a = d.get(lo)
            if a is None:
                d[lo] = [runs, seconds]
            else:
                a[0] += runs
                a[1] += seconds
            b = d.get(hi + 1)
            if b is None:
                d[hi + 1] = [-runs, -seconds]
            else:
                b[0] -= runs
                b[1] -= seconds

    def add_names(self, names: Iterable[str], size: int, seconds: int) -> None:
        """Names `ranges` does not handle, one at a time."""
        for n in names:
            self.add((((n, -1, ""), 0, 0),), size, seconds)

    def spread(self) -> Iterator[tuple[str, int, int, int]]:
        """(node, size bucket, runs, seconds) for every node with runs; the tally is then
        empty."""
        self._fold()
        for (key, size), d in self._diff.items():
            runs = secs = 0
            points = sorted(d)
            for at, nxt in pairwise(points):
                runs += d[at][0]
                secs += d[at][1]
                if runs <= 0:
                    continue
                for i in range(at, nxt):  # a name without a number: at 0, nxt 1
                    yield name(key, i), size, runs, secs
        self._diff.clear()
