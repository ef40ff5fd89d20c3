"""Why the joint fit did or did not put a node's failures on it, in words. Pure.

Everything per failed run that the words need (which node events name, which node's rate
explains the most, what the background leaves) is computed once over the whole incidence, so
explaining a node costs what its own entries do, not a pass over every run it was in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import overload

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.blames import Blame, Blames
from gpuwarden.accounting.incidence import (
    CULPRIT,
    NO_JOB,
    FloatArray,
    Incidence,
    IndexArray,
    IntArray,
)
from gpuwarden.lemon.inference import Fit

BACKGROUND = "the background rate of its job size"
LEFT_OUT = ("held against no node (failures the user decided, of a job that named its nodes "
            "or of a source left out)")
NONE = -1  # no entry; as an explainer code: the background
LEFT = -2  # as an explainer code: a run the fit leaves out (no hazard counts in it)


def _first_per_row(hit: np.ndarray, row: IntArray, rows: int) -> IntArray:
    """Per row, its first entry where ``hit`` holds (NONE if none); entries are row-ordered."""
    idx = np.flatnonzero(hit)
    out = np.full(rows, NONE, dtype=np.int64)
    if len(idx):
        r = row[idx]
        first = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
        out[r[first]] = idx[first]
    return out


def _per_row(ufunc: np.ufunc, values: FloatArray, inc: Incidence, empty: float) -> FloatArray:
    """``ufunc`` reduced over each row's entries (``empty`` for a row without any)."""
    out = np.full(inc.rows, empty)
    starts = inc.ptr[:-1]
    full = inc.ptr[1:] > starts
    if full.any():
        out[full] = ufunc.reduceat(values, starts[full])
    return out


def _top(inc: Incidence, share: FloatArray, row: IntArray, among: np.ndarray) -> IntArray:
    """Per row, the first entry with the largest share among the entries ``among``."""
    vals = np.where(among, share, -np.inf)
    best = _per_row(np.maximum, vals, inc, -np.inf)
    return _first_per_row(among & (vals == best[row]), row, inc.rows)


def _other_node(first: IntArray, inc: Incidence, row: IntArray) -> np.ndarray:
    """Per entry: its node is not that of its row's ``first`` entry."""
    head = np.where(first >= 0, inc.node[np.maximum(first, 0)], NONE)
    out: np.ndarray = inc.node != head[row]
    return out


def _own(inc: Incidence, share: FloatArray, row: IndexArray) -> FloatArray:
    """Per entry: the share of its row on its node (a node listed twice: both entries).
    ``share`` itself where no row lists a node twice (a sum of one is that one, bit for bit):
    a second array of it was a tenth of a GiB through a year's lemons."""
    order, _ = inc.by_node()
    if not len(order):
        return np.zeros(len(share))
    n, r = inc.node[order], row[order]
    start = np.r_[True, (n[1:] != n[:-1]) | (r[1:] != r[:-1])]
    del n, r
    if start.all():
        return share
    out = np.zeros(len(share))
    sums = np.add.reduceat(share[order], np.flatnonzero(start))
    out[order] = sums[np.cumsum(start) - 1]
    return out


@dataclass(frozen=True, eq=False)
class RowView:
    """Per failed run: what explains it, from the fit."""

    inc: Incidence
    fit: Fit
    share: FloatArray  # per entry
    row: IntArray  # per entry
    own: FloatArray  # per entry: its node's share of its row
    background: FloatArray  # per row: the part no node's rate explains
    culprit: IntArray  # per row: its first entry events name (NONE: none)
    culprit2: IntArray  # per row: the first of another node than `culprit`'s
    top: IntArray  # per row: the first entry with the largest share
    top2: IntArray  # per row: the same among other nodes than `top`'s

    @classmethod
    def of(cls, inc: Incidence, f: Fit) -> RowView:
        share, row = f.share(inc), inc.entry_row()
        named = (inc.flags & CULPRIT) > 0
        culprit = _first_per_row(named, row, inc.rows)
        top = _top(inc, share, row, np.ones(len(share), dtype=bool))
        return cls(inc, f, share, row, _own(inc, share, row),
                   1.0 - _per_row(np.add, share, inc, 0.0), culprit,
                   _first_per_row(named & _other_node(culprit, inc, row), row, inc.rows),
                   top, _top(inc, share, row, _other_node(top, inc, row)))

    def explainers(self, rows: IntArray, node: int) -> IntArray:
        """Per run in ``rows``, what explains its failure when it is not ``node``: a node
        events name (its index), a node whose rate explains the most (its index + the number
        of nodes), or the background (NONE). See `label`."""
        node_of = self.inc.node
        c = self.culprit[rows]
        c = np.where((c >= 0) & (node_of[np.maximum(c, 0)] != node), c, self.culprit2[rows])
        t = self.top[rows]
        t = np.where((t >= 0) & (node_of[np.maximum(t, 0)] != node), t, self.top2[rows])
        # A run whose other nodes all explain less than the background is the background's.
        value = np.where(t >= 0, self.share[np.maximum(t, 0)], -1.0)
        plain = np.where((t >= 0) & (value >= self.background[rows]),
                         node_of[np.maximum(t, 0)] + len(self.inc.names), NONE)
        out: IntArray = np.where(c >= 0, node_of[np.maximum(c, 0)], plain)
        # A run nothing in the fit counts for was left out of it: saying the background
        # explains it would be untrue (and the background's rate does not include it).
        out[self.fit.row_rate[rows] <= 0] = LEFT
        return out

    def label(self, code: int) -> str:
        names = self.inc.names
        if code == NONE:
            return BACKGROUND
        if code == LEFT:
            return LEFT_OUT
        if code < len(names):
            return f"{names[code]} (events say it failed)"
        return names[code - len(names)]

    def node_shares(self, rows: IntArray, entries: IntArray) -> FloatArray:
        """Per run in ``rows``, the share on the node whose ``entries`` (row order) these are;
        0 for a run without it."""
        if not len(entries):
            return np.zeros(len(rows))
        at = self.row[entries]
        pos = np.minimum(np.searchsorted(at, rows), len(entries) - 1)
        hit = at[pos] == rows
        out: FloatArray = np.where(hit, self.own[entries[pos]], 0.0)
        return out


def explain(view: RowView, node: int, entries: IntArray, null: float,
            left_out: str, attributed: float | None = None) -> str:
    """One line: how many failed runs, how many the node explains, what explains the rest.
    ``attributed``: what the node's test put on it, where it had one (the ATTRIB column):
    with a source left out of the test alone, the fit's shares would say more than stood."""
    if len(entries) == 0:
        return "no failed runs"
    own = float(view.share[entries].sum()) if attributed is None else attributed
    low = entries[view.own[entries] < 0.5]
    others: Counter[int] = Counter(view.explainers(view.row[low], node).tolist())
    expected = null * float(view.inc.node_hours[node])
    parts = [f"{len(entries)} failed run(s) included it; the fit puts {own:.1f} on it "
             f"(a node like the fleet: {expected:.1f})"]
    # `most_common(3)`'s order (count, then first seen) by a C sort: its heap walks every
    # code in Python, 12,500 nodes' worth at 10M records.
    for code, k in sorted(others.items(), key=itemgetter(1), reverse=True)[:3]:
        if code == NONE:
            parts.append(f"{k} are explained by {BACKGROUND}")
        elif code == LEFT:
            parts.append(f"{k} are {LEFT_OUT}")
        else:
            parts.append(f"{k} of its {len(entries)} failures were in jobs with "
                         f"{view.label(code)}, which explains them")
    if left_out:
        parts.append(f"tested with {left_out} (one source's evidence)")
    return "; ".join(parts)


@dataclass(frozen=True, eq=False)
class _Keys:
    """Each row's (job id, end) as one number: the ranks of both among their distinct values
    (``jobs``, ``ends``), in order (``keys``, stable: ``rows``)."""

    jobs: IntArray
    ends: FloatArray
    keys: IntArray
    rows: IntArray


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (as `np.unique`, by a sort: numpy 2's `np.unique` hashes
    whole numbers first, and took 0.8 s for a year's million job ids, a sort 0.06 s). NaNs
    stay apart, which finds the same rows: a NaN end finds none (`_rank`)."""
    a = np.sort(values)
    if not len(a):
        return a
    keep = np.empty(len(a), dtype=np.bool_)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    out: np.ndarray = a[keep]
    return out


def _rank(values: np.ndarray, among: np.ndarray) -> tuple[IntArray, npt.NDArray[np.bool_]]:
    """Each value's place in ``among`` (sorted, distinct) and whether it is there."""
    at = np.searchsorted(among, values)
    on = at < len(among)
    on[on] = among[at[on]] == values[on]
    return at.astype(np.int64), on


class RowIndex:
    """The incidence row of a blamed run, by (job id, end): the last row with both; built on
    first use, as sorted numbers (a dict of a year's million rows by key held a fifth of a
    GiB through the lemons' evidence). Also each annotated reason once (`reason`)."""

    def __init__(self, inc: Incidence) -> None:
        self._inc = inc
        self._keys: _Keys | None = None
        self._texts: dict[tuple[str, str], str] = {}
        self._runs: _Runs | None = None

    def runs(self, blames: Blames) -> _Runs:
        """Every run of ``blames`` with its row (`rows`) and its reason, found once (again
        only where ``blames`` grew or is another)."""
        got = self._runs
        if got is None or got.blames is not blames or got.runs != blames.runs():
            got = self._runs = _runs_of(blames, self)
        return got

    def _built(self) -> _Keys:
        if self._keys is None:
            inc = self._inc
            jobs, ends = _distinct(inc.job), _distinct(inc.end)
            keys = (_rank(inc.job, jobs)[0] * len(ends) + _rank(inc.end, ends)[0])
            rows = np.argsort(keys, kind="stable")
            self._keys = _Keys(jobs, ends, keys[rows], rows)
        return self._keys

    def rows(self, jobs: IntArray, ends: FloatArray) -> IntArray:
        """Per (job id, end): the last row with both, -1 where none (an end that is NaN
        finds none, as a dict of floats finds none)."""
        k = self._built()
        if not len(k.rows):
            return np.full(len(jobs), -1, dtype=np.int64)
        j, j_on = _rank(jobs, k.jobs)
        e, e_on = _rank(ends, k.ends)
        want = j * len(k.ends) + e
        at = np.searchsorted(k.keys, want, side="right") - 1
        hit = j_on & e_on & (at >= 0)
        hit[hit] = k.keys[at[hit]] == want[hit]
        out: IntArray = np.where(hit, k.rows[np.maximum(at, 0)], -1)
        return out

    def reason(self, reason: str, note: str) -> str:
        """``reason`` with ``note``, one string for each such pair: a year's lemons hold 1.3
        million pieces of evidence and 3 thousand distinct reasons (a string each was a fifth
        of a GiB)."""
        key = (reason, note)
        got = self._texts.get(key)
        if got is None:
            got = self._texts[key] = f"{reason}; {note}"
        return got


@dataclass(frozen=True, eq=False)
class _Runs:
    """Per run of one `Blames` (as long as it held ``runs`` runs): its incidence row (-1:
    none), its reason, and a number for that reason; found once for every node's evidence
    (a search of a year's incidence for each node's runs in turn was a tenth of its
    lemons' CPU time)."""

    blames: Blames
    runs: int
    row: IntArray
    reason: npt.NDArray[np.object_]
    code: IntArray


def _runs_of(blames: Blames, rows_by_job: RowIndex) -> _Runs:
    n = blames.runs()
    job = np.frombuffer(blames.job, dtype=np.int64)
    at = np.frombuffer(blames.at, dtype=np.float64)
    row = rows_by_job.rows(job, at) if n else np.zeros(0, dtype=np.int64)
    del job, at  # views of the Blames' buffers: held, they would keep it from growing
    reason = np.empty(n, dtype=object)
    reason[:] = blames.reason
    # Each distinct reason is one string (`Blames`); a second equal string only makes a
    # second group of the same texts.
    ids = np.fromiter(map(id, blames.reason), dtype=np.uint64, count=n)
    code = np.unique(ids, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return _Runs(blames, n, row, reason, code)


def _note(view: RowView, s: float, w: int, label: dict[int, str]) -> str:
    """What a blamed run's reason gets: the node's share ``s`` of it, or what explains it
    (``w``, `RowView.explainers`)."""
    if s >= 0.5:
        return f"{s:.0%} of it on this node"
    if w == LEFT:
        return LEFT_OUT
    name = label.get(w)
    if name is None:
        name = label[w] = view.label(w)
    return f"explained by {name} ({s:.0%} on this node)"


def _noted(view: RowView, rows_by_job: RowIndex, base: npt.NDArray[np.object_],
           code: IntArray, shares: FloatArray, who: IntArray) -> npt.NDArray[np.object_]:
    """Each reason in ``base`` with its note (`_note`), each distinct text made once: runs
    with the same reason (``code``), the same explainer and the same share in whole percent
    read the same (``f"{s:.0%}"`` is ``s * 100`` rounded half to even, as `np.rint`)."""
    label: dict[int, str] = {}
    out = np.empty(len(base), dtype=object)
    pct = shares * 100
    whole = np.rint(pct)
    kind = np.where(shares >= 0.5, 0, np.where(who == LEFT, 1, who.astype(np.int64) + 4))
    whole[kind == 1] = 0
    if len(base) and (np.isfinite(pct).all() and not np.signbit(shares).any()
                      and whole.max() < 2**20):
        k_n, p_n = int(kind.max()) + 1, int(whole.max()) + 1
        if (int(code.max()) + 1) * k_n * p_n < 2**62:
            key = (code * k_n + kind) * p_n + whole.astype(np.int64)
            _, first, inv = np.unique(key, return_index=True, return_inverse=True)
            texts = np.empty(len(first), dtype=object)
            for t, i in enumerate(first.tolist()):
                texts[t] = rows_by_job.reason(base[i], _note(view, float(shares[i]),
                                                               int(who[i]), label))
            out[:] = texts[inv.reshape(-1)]
            return out
    # A share that is not a plain number (NaN, -0.0): each on its own, as `f"{s:.0%}"` says.
    for k, (b, s, w) in enumerate(zip(base.tolist(), shares.tolist(), who.tolist(),
                                      strict=True)):
        out[k] = rows_by_job.reason(b, _note(view, s, w, label))
    return out


def annotate(view: RowView, node: int, blames: Blames, places: Sequence[int] | IntArray,
             rows_by_job: RowIndex, entries: IntArray) -> Annotated:
    """The blames at ``places``, each blamed run with the node's share of it, or what explains
    it instead, added to its reason. Made once each from the columns: a copy of each Blame
    with its reason changed (`dataclasses.replace`) was most of a year's lemons' evidence
    (1.4 million pieces); a note per piece in Python was still half of it."""
    at = np.asarray(places, dtype=np.int64).reshape(-1)
    t = rows_by_job.runs(blames)
    run = np.frombuffer(blames.run, dtype=np.int32)[at] if len(at) else np.zeros(0, np.int64)
    got = t.row[run]
    found = np.flatnonzero(got >= 0)
    rows = got[found]
    reasons = t.reason[run]
    if len(found):
        reasons[found] = _noted(view, rows_by_job, reasons[found], t.code[run[found]],
                                view.node_shares(rows, entries), view.explainers(rows, node))
    return Annotated(blames, at, reasons.tolist())


@dataclass(frozen=True)
class Columns:
    """A node's evidence as columns: per piece its run's time, job id (`NO_JOB`: none),
    annotated reason and weight."""

    at: FloatArray
    job: IntArray
    reason: list[str]
    weight: FloatArray


class Annotated(Sequence[Blame]):
    """The blames at ``places`` with ``reasons`` (`annotate`'s), made when read; `pieces`
    and `columns` read them without making any (a year's lemons hold 1.4 million: as
    Blames, 0.3 GiB and seconds the report then turned into its own rows)."""

    def __init__(self, blames: Blames, places: IntArray, reasons: list[str]) -> None:
        self._blames, self._places, self._reasons = blames, places, reasons

    def __len__(self) -> int:
        return len(self._places)

    @overload
    def __getitem__(self, i: int) -> Blame: ...
    @overload
    def __getitem__(self, i: slice) -> list[Blame]: ...
    def __getitem__(self, i: int | slice) -> Blame | list[Blame]:
        if isinstance(i, slice):
            at = range(len(self))[i]
            return list(self._blames.at_rows([int(self._places[k]) for k in at],
                                             [self._reasons[k] for k in at]))
        k = range(len(self))[i]
        return next(self._blames.at_rows((int(self._places[k]),), (self._reasons[k],)))

    def __iter__(self) -> Iterator[Blame]:
        return self._blames.at_rows(self._places.tolist(), self._reasons)

    def pieces(self) -> Iterator[tuple[float, int | None, str, float]]:
        """(at, job id, reason, weight) of each, in order."""
        b = self._blames
        run, job, at, weight = b.run, b.job, b.at, b.weight
        for i, why in zip(self._places.tolist(), self._reasons, strict=True):
            r = run[i]
            j = job[r]
            yield at[r], None if j == NO_JOB else j, why, weight[r]

    def columns(self) -> Columns:
        """`pieces` as columns."""
        b = self._blames
        if not len(self._places):
            return Columns(np.zeros(0), np.zeros(0, dtype=np.int64), [], np.zeros(0))
        run = np.frombuffer(b.run, dtype=np.int32)[self._places]
        # Copies (fancy indexing), not views: a view of the Blames' buffers would keep it
        # from growing.
        return Columns(np.frombuffer(b.at, dtype=np.float64)[run],
                       np.frombuffer(b.job, dtype=np.int64)[run], self._reasons,
                       np.frombuffer(b.weight, dtype=np.float64)[run])


class LazyEvidence(Sequence[Blame]):
    """A node's evidence list, built when first read: at millions of runs, annotating every
    node's runs cost more than the fit, and most nodes' lists are never shown."""

    def __init__(self, build: Callable[[], Sequence[Blame]]) -> None:
        self._build: Callable[[], Sequence[Blame]] | None = build
        self._items: Sequence[Blame] = ()

    def _get(self) -> Sequence[Blame]:
        if self._build is not None:
            self._items, self._build = self._build(), None
        return self._items

    def pieces(self) -> Iterator[tuple[float, int | None, str, float]]:
        """(at, job id, reason, weight) of each, in order, without making the Blames where
        the list was annotated (`Annotated.pieces`)."""
        got = self._get()
        if isinstance(got, Annotated):
            return got.pieces()
        return ((b.at, b.job_id, b.reason, b.weight) for b in got)

    def columns(self) -> Columns | None:
        """`Annotated.columns` where the list was annotated (None: read `pieces`)."""
        got = self._get()
        return got.columns() if isinstance(got, Annotated) else None

    @overload
    def __getitem__(self, i: int) -> Blame: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Blame, ...]: ...
    def __getitem__(self, i: int | slice) -> Blame | tuple[Blame, ...]:
        if isinstance(i, slice):
            return tuple(self._get()[i])
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[Blame]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self._get()) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self._get()))

    def __repr__(self) -> str:
        return repr(tuple(self._get()))

    def __reduce__(self) -> tuple[type, tuple[tuple[Blame, ...]]]:
        return tuple, (tuple(self._get()),)  # pickled as what it reads as
