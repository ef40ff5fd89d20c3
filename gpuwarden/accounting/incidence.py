"""The job-node incidence the lemon inference fits: compact, filled from a stream of runs.

Interface (what a streaming accounting reader fills; nothing per job is kept for a run that
did not fail):

* per node: node-hours of every run (exposure), kept by the caller (`Attribution.exposure`)
  and handed to `IncidenceBuilder.freeze`;
* per size bucket: job-hours of every run (`add_hours`), the exposure of the background
  hazard (the fabric, the user's own gang failures) that grows with job size;
* per user and per job script: node-hours of every run (`add_source_hours`), so that a source
  is measured against its share of the fleet's runs (`Incidence.user_share`);
* per failed run (`add_failure`): its node indices, hours, size bucket, user, job script,
  and per node two flags: `CULPRIT` (an event or sacct's `failed_node` names the node as the
  one that failed) and `NAMED` (the job asked for the node by name, -w/--nodelist); and whether
  the outcome is one the user decides (`gameable`: FAILED with an exit code, nothing naming
  a node). A node failure event with no run behind it is a one-node failure, 0 hours.

Rows live in flat `array` buffers (CSR: `ptr` into `node`/`flags`), about 30 bytes per failed
run plus 5 per node in it; `freeze` turns them into numpy arrays. Builders from separate
files or workers merge (`merge`), remapping node, user and script numbers.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

CULPRIT = 1
NAMED = 2
NO_JOB = -1
NO_SCRIPT = -1

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
# Per-entry numbers and positions: int32 where they fit (`index_dtype`). A year of a
# 12,500-node fleet holds tens of millions of entries, and each int64 array of them was
# hundreds of MiB of the report's peak.
IndexArray = npt.NDArray[np.signedinteger[Any]]
FlagArray = npt.NDArray[np.int8]

_INT32_MAX = np.iinfo(np.int32).max


def index_dtype(n: int) -> type[np.signedinteger[Any]]:
    """The narrowest of int32 and int64 that holds the numbers 0..n."""
    return np.int32 if n <= _INT32_MAX else np.int64


def grouped(codes: npt.NDArray[np.signedinteger[Any]], n: int) -> IndexArray:
    """The places of ``codes`` (each in 0..n-1) by code, in order within each
    (`index_dtype`): their stable argsort. Up to 65,536 codes (a fleet's nodes) sorted as
    uint16, which numpy sorts by radix: tens of millions of entries took seconds of the year
    report as int32."""
    keys = codes.astype(np.uint16) if n <= 1 << 16 else codes
    return np.argsort(keys, kind="stable").astype(index_dtype(len(codes)))


def _ix(table: dict[str, int], key: str) -> int:
    i = table.get(key)
    if i is None:
        i = table[key] = len(table)
    return i


def numbered(table: dict[str, int], keys: Iterable[str]) -> list[int]:
    """Each key's number in ``table``, numbering new ones in order (`_ix` of each): read by
    one lookup each where every key is known (most calls: a fleet's nodes and users repeat)."""
    keys = keys if isinstance(keys, (list, tuple)) else list(keys)
    got = list(map(table.get, keys))
    if None in got:
        got = [_ix(table, k) for k in keys]
    return got  # type: ignore[return-value]  # no None left


def int32s(rows: Sequence[Sequence[int]]) -> bytes:
    """The numbers of ``rows``, one row after another, as int32s (an ``array("i")``'s bytes):
    by one join where each row is an ``array("i")`` (`counted.Judge`'s), else packed by value
    (a join of other buffers would read their bytes as int32s)."""
    if all(type(r) is array and r.typecode == "i" for r in rows):
        return b"".join(rows)  # type: ignore[arg-type]  # arrays: buffers
    return array("i", chain.from_iterable(rows)).tobytes()


def offsets(rows: Sequence[Sized], base: int) -> npt.NDArray[np.int64]:
    """Where each of ``rows`` ends when they are laid one after another from ``base``."""
    return np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))) + base


def _flags(listed: tuple[str, ...], culprit: AbstractSet[str],
           pinned: AbstractSet[str]) -> bytes:
    """Per node of ``listed``: `CULPRIT` if in ``culprit``, `NAMED` if in ``pinned``. Where
    the sets are a few nodes of a gang, each found by a scan of the list (C's) rather than
    each node looked up in them (`attribution.settle`'s gangs: 5.4M nodes at a year)."""
    if len(culprit) + len(pinned) > 8 or len(listed) < 16:
        return bytes([(CULPRIT if n in culprit else 0) | (NAMED if n in pinned else 0)
                      for n in listed])
    out = bytearray(len(listed))
    for names, flag in ((culprit, CULPRIT), (pinned, NAMED)):
        for at, _ in places(listed, names):
            out[at] |= flag
    return bytes(out)


def places(listed: Sequence[str], names: Iterable[str]) -> list[tuple[int, str]]:
    """Every place of each of ``names`` in ``listed``, with the name: by a scan of the list
    (C's) for each, where they are a few names of a long list."""
    found = []
    for n in names:
        at = -1
        while True:
            try:
                at = listed.index(n, at + 1)
            except ValueError:
                break
            found.append((at, n))
    return found


@dataclass
class IncidenceBuilder:
    nodes: dict[str, int] = field(default_factory=dict)
    users: dict[str, int] = field(default_factory=dict)
    scripts: dict[str, int] = field(default_factory=dict)
    ptr: array[int] = field(default_factory=lambda: array("q", [0]))
    node: array[int] = field(default_factory=lambda: array("i"))
    flags: array[int] = field(default_factory=lambda: array("b"))
    hours: array[float] = field(default_factory=lambda: array("d"))
    end: array[float] = field(default_factory=lambda: array("d"))
    job: array[int] = field(default_factory=lambda: array("q"))
    user: array[int] = field(default_factory=lambda: array("i"))
    script: array[int] = field(default_factory=lambda: array("i"))
    size: array[int] = field(default_factory=lambda: array("b"))
    gameable: array[int] = field(default_factory=lambda: array("b"))
    bucket_hours: dict[int, float] = field(default_factory=dict)
    user_hours: dict[int, float] = field(default_factory=dict)  # node-hours, by user index
    script_hours: dict[int, float] = field(default_factory=dict)  # by script index
    _numbered: dict[tuple[str, ...], array[int]] = field(default_factory=dict, repr=False,
                                                         compare=False)

    def __getstate__(self) -> dict[str, object]:
        """Pickled (a worker's builder, sent back to be merged) without `_numbers`' cache."""
        return {k: v for k, v in self.__dict__.items() if k != "_numbered"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state, _numbered={})

    def add_hours(self, size: int, hours: float) -> None:
        self.bucket_hours[size] = self.bucket_hours.get(size, 0.0) + hours

    def add_source_hours(self, user: str, script: str, node_hours: float) -> None:
        """Node-hours of runs by ``user`` of ``script`` ("" when unknown: no script)."""
        u = _ix(self.users, user)
        self.user_hours[u] = self.user_hours.get(u, 0.0) + node_hours
        if script:
            k = _ix(self.scripts, script)
            self.script_hours[k] = self.script_hours.get(k, 0.0) + node_hours

    def add_failure(self, job_id: int | None, end: float, hours: float, size: int,
                    nodes: Iterable[str], culprits: Iterable[str] = (),
                    named: Iterable[str] = (), user: str = "", script: str = "",
                    gameable: bool = False) -> None:
        culprit = culprits if isinstance(culprits, AbstractSet) else set(culprits)
        pinned = named if isinstance(named, AbstractSet) else set(named)
        listed = nodes if isinstance(nodes, tuple) else tuple(nodes)
        self.node.extend(self._numbers(listed))
        if culprit or pinned:
            self.flags.frombytes(_flags(listed, culprit, pinned))
        else:
            self.flags.frombytes(bytes(len(listed)))
        self._end_row(job_id, end, hours, size, user, script, gameable)

    def _numbers(self, nodes: tuple[str, ...]) -> array[int]:
        """`node_numbers` of a node list, kept per list: failed runs repeat their lists (a
        gang's block, a year's months), and numbering each node of each was most of judging
        the runs that claim failure events (`attribution.settle`). As int32s (`node`'s
        own), added by a copy rather than an int each."""
        got = self._numbered.get(nodes)
        if got is None:
            got = self._numbered[nodes] = array("i", self.node_numbers(nodes))
        return got

    def node_numbers(self, nodes: Iterable[str]) -> list[int]:
        """Each node's number in the rows, numbering new ones as `add_failure` would."""
        return numbered(self.nodes, nodes)

    def add_plain_failure(self, job_id: int, end: float, hours: float, size: int,
                          numbers: list[int], user: str, script: str, gameable: bool) -> None:
        """`add_failure` of the nodes numbered ``numbers`` (`node_numbers`), none a culprit
        nor named: a failed gang run's nodes at once."""
        self.node.extend(numbers)
        self.flags.frombytes(bytes(len(numbers)))
        self._end_row(job_id, end, hours, size, user, script, gameable)

    def add_plain_failures(self, job_ids: Sequence[int], ends: Sequence[float],
                           hours: Sequence[float], sizes: Sequence[int],
                           numbers: Sequence[Sequence[int]], users: Sequence[str],
                           scripts: Sequence[str], gameable: Sequence[bool]) -> None:
        """`add_plain_failure` of each run, by column: a call and eight appends a run were a
        third of judging a year's failed runs (`counted.Judge`). ``numbers``: lists, or
        ``array("i")``s, joined at once (`int32s`)."""
        if not numbers:
            return
        base = len(self.node)
        self.node.frombytes(int32s(numbers))
        self.flags.frombytes(bytes(len(self.node) - base))
        self.ptr.frombytes(offsets(numbers, base).tobytes())
        self.hours.extend(hours)
        self.end.extend(ends)
        self.job.extend(job_ids)
        self.user.extend(numbered(self.users, users))
        if all(scripts):
            self.script.extend(numbered(self.scripts, scripts))
        else:
            names = self.scripts
            self.script.extend([_ix(names, k) if k else NO_SCRIPT for k in scripts])
        self.size.extend(sizes)
        self.gameable.extend(map(bool, gameable))  # numpy's bools are no ints to array

    def _end_row(self, job_id: int | None, end: float, hours: float, size: int, user: str,
                 script: str, gameable: bool) -> None:
        """Close a failed run's row, its nodes added: the run's own columns."""
        self.ptr.append(len(self.node))
        self.hours.append(hours)
        self.end.append(end)
        self.job.append(NO_JOB if job_id is None else job_id)
        self.user.append(_ix(self.users, user))
        self.script.append(_ix(self.scripts, script) if script else NO_SCRIPT)
        self.size.append(size)
        self.gameable.append(1 if gameable else 0)

    def merge(self, other: IncidenceBuilder) -> IncidenceBuilder:
        nmap = [_ix(self.nodes, n) for n in other.nodes]
        umap = [_ix(self.users, u) for u in other.users]
        smap = [_ix(self.scripts, s) for s in other.scripts]
        base = len(self.node)
        self.node.extend(nmap[i] for i in other.node)
        self.flags.extend(other.flags)
        self.ptr.extend(p + base for p in other.ptr[1:])
        self.hours.extend(other.hours)
        self.end.extend(other.end)
        self.job.extend(other.job)
        self.user.extend(umap[u] for u in other.user)
        self.script.extend(NO_SCRIPT if s == NO_SCRIPT else smap[s] for s in other.script)
        self.size.extend(other.size)
        self.gameable.extend(other.gameable)
        for b, h in other.bucket_hours.items():
            self.add_hours(b, h)
        for u, h in other.user_hours.items():
            self.user_hours[umap[u]] = self.user_hours.get(umap[u], 0.0) + h
        for k, h in other.script_hours.items():
            self.script_hours[smap[k]] = self.script_hours.get(smap[k], 0.0) + h
        return self

    def freeze(self, node_hours: Mapping[str, float]) -> Incidence:
        """The arrays the inference reads; ``node_hours``: every node's exposure."""
        names = dict(self.nodes)
        for n in node_hours:
            _ix(names, n)
        hours = np.zeros(len(names))
        for n, h in node_hours.items():
            hours[names[n]] = h
        nb = max([*self.bucket_hours, *self.size, 0]) + 1
        bucket = np.zeros(nb)
        for b, h in self.bucket_hours.items():
            bucket[b] = h
        ptr = np.frombuffer(self.ptr, dtype=np.int64) if len(self.ptr) else np.zeros(1, np.int64)
        # The entries' node numbers and flags are the builder's own buffers (int32, int8), not
        # copies: as int64 copies beside them they were 21 bytes an entry more at the peak.
        # The builder cannot grow while the Incidence reads them (BufferError), as it could
        # not already for its hours and ends.
        return Incidence(
            names=tuple(names), node_hours=hours, bucket_hours=bucket,
            ptr=ptr.astype(np.int64), node=np.asarray(self.node, dtype=np.int32),
            flags=np.asarray(self.flags, dtype=np.int8),
            hours=np.asarray(self.hours, dtype=np.float64),
            end=np.asarray(self.end, dtype=np.float64), job=np.asarray(self.job, dtype=np.int64),
            user=np.asarray(self.user, dtype=np.int64),
            script=np.asarray(self.script, dtype=np.int64),
            size=np.asarray(self.size, dtype=np.int64),
            gameable=np.asarray(self.gameable, dtype=bool),
            users=tuple(self.users), scripts=tuple(self.scripts),
            user_hours=_dense(self.user_hours, len(self.users)),
            script_hours=_dense(self.script_hours, len(self.scripts)))


def _dense(by_index: Mapping[int, float], n: int) -> FloatArray:
    out = np.zeros(n)
    for i, h in by_index.items():
        out[i] = h
    return out


def _share(hours: FloatArray, n: int, total: float) -> FloatArray:
    out = np.zeros(n)
    if total > 0:
        out[:len(hours)] = hours[:n] / total
    return out


@dataclass(frozen=True, eq=False)
class Incidence:
    """Failed runs x nodes (CSR) and every node's exposure, as numpy arrays."""

    names: tuple[str, ...]
    node_hours: FloatArray  # per node
    bucket_hours: FloatArray  # per size bucket: job-hours of every run
    ptr: IntArray  # rows: failed runs; entries ptr[r]:ptr[r+1]
    node: IndexArray  # per entry (int32)
    flags: FlagArray  # per entry: CULPRIT | NAMED
    hours: FloatArray  # per row
    end: FloatArray
    job: IntArray
    user: IntArray
    script: IntArray
    size: IntArray
    gameable: npt.NDArray[np.bool_]
    users: tuple[str, ...]
    scripts: tuple[str, ...]
    # Node-hours of every run, by user and by script (the exposure the sources' shares of the
    # fleet's runs come from); empty arrays read as no runs known.
    user_hours: FloatArray = field(default_factory=lambda: np.zeros(0))
    script_hours: FloatArray = field(default_factory=lambda: np.zeros(0))

    @property
    def rows(self) -> int:
        return len(self.hours)

    def user_share(self) -> FloatArray:
        """Per user: its share of the fleet's node-hours (0 where none are known)."""
        return _share(self.user_hours, len(self.users), float(self.user_hours.sum()))

    def script_share(self) -> FloatArray:
        """Per script: its share of the fleet's node-hours (runs of no known script count
        in the whole)."""
        return _share(self.script_hours, len(self.scripts), float(self.user_hours.sum()))

    def entry_row(self) -> IndexArray:
        """Per entry, its row (read-only; built once: every per-node step reads it);
        `index_dtype`."""
        return self._entry_row

    def by_node(self) -> tuple[IndexArray, IntArray]:
        """Entries grouped by node: ``order[bounds[i]:bounds[i + 1]]`` are node i's, in row
        order (read-only; built once); ``order``: `index_dtype`."""
        return self._by_node

    @cached_property
    def _entry_row(self) -> IndexArray:
        out = np.repeat(np.arange(self.rows, dtype=index_dtype(self.rows)), np.diff(self.ptr))
        out.setflags(write=False)
        return out

    @cached_property
    def _by_node(self) -> tuple[IndexArray, IntArray]:
        order = grouped(self.node, len(self.names))
        bounds = np.searchsorted(self.node[order], np.arange(len(self.names) + 1))
        order.setflags(write=False)
        bounds.setflags(write=False)
        return order, bounds
