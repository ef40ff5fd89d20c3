"""The blames of an attribution, kept as columns. Pure.

A failed gang run is blamed on each of its nodes with the same weight, time, reason, size and
GPU class: those are kept once per run, and per blame only its node (a number) and its run.
A year of a 12,500-node fleet holds about 8 million blames; as `Blame` objects they took
1.8 GiB and most of the time spent judging the failed runs. A `Blame` is made when one is read
(`Blames` is a sequence of them); the readers that walk every blame read the columns
(`on_nodes`, `firsts`, `node_codes`). A run's job id is kept as a number (`NO_JOB`: none) and
its reason as one string per distinct reason: as Python ints and a string per run they were
about 130 bytes a run, a tenth of a GiB at a year.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import overload

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.incidence import NO_JOB, int32s


@dataclass(frozen=True, slots=True)  # a year's report holds a million at once (`firsts`)
class Blame:
    node: str
    weight: float
    job_id: int | None
    at: float
    reason: str
    size: int = 0  # size bucket of the run; 0 for a drain without a run (rule 5)
    # The evidence names this node (a one-node run, the node an event says failed, a drain),
    # rather than spreading a gang job's failure over all of its nodes.
    pinned: bool = True
    started: float | None = None  # when the blamed run started
    gpus: int = 0  # the blamed run's GPU class (`gpu_class`); 0 without GPUs, or no run


# Each slot's own setter: what the dataclass's __init__ reaches through object.__setattr__
# (a frozen field), at 3x the cost.
_SET = tuple(getattr(Blame, f).__set__ for f in Blame.__slots__)


def _make(node: str, weight: float, job_id: int | None, at: float, reason: str, size: int,
          pinned: bool, started: float | None, gpus: int,
          _new: Callable[[type[Blame]], Blame] = object.__new__,
          _set: tuple[Callable[[Blame, object], None], ...] = _SET) -> Blame:
    """A Blame, its slots filled directly (slots: 170 bytes a Blame with its floats, 390 with
    a __dict__; the report's cards hold one per blamed run of a year, a million)."""
    b = _new(Blame)
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = _set
    s0(b, node)
    s1(b, weight)
    s2(b, job_id)
    s3(b, at)
    s4(b, reason)
    s5(b, size)
    s6(b, pinned)
    s7(b, started)
    s8(b, gpus)
    return b


class Blames(Sequence[Blame]):
    """Blames in the order they were added: per run (what one `add_run` or `append` added)
    its weight, job, time, reason, size, pinning, start and GPU class; per blame its node's
    number (`names`) and its run."""

    def __init__(self, blames: Iterable[Blame] = ()) -> None:
        self.names: list[str] = []  # node numbers' names
        self._number: dict[str, int] = {}
        self.node = array("i")  # per blame
        self.run = array("i")  # per blame
        self.weight = array("d")  # per run from here on
        self.job = array("q")  # NO_JOB: None
        self.at = array("d")
        self.reason: list[str] = []  # each distinct reason one string (`_reasons`)
        self._reasons: dict[str, str] = {}
        self.size = array("q")
        self.pinned = array("b")
        self.started = array("d")  # NaN: None
        self.gpus = array("q")
        self.extend(blames)

    # -- adding ------------------------------------------------------------------------------

    def numbers(self, nodes: Iterable[str]) -> list[int]:
        """Each node's number, numbering new ones (for `add_run`): by one lookup each where
        every node is numbered already (most lists: a fleet's nodes repeat)."""
        table = self._number
        nodes = nodes if isinstance(nodes, (list, tuple)) else list(nodes)
        known = list(map(table.get, nodes))
        if None not in known:
            return known  # type: ignore[return-value]  # none None
        out = []
        for n in nodes:
            i = table.get(n)
            if i is None:
                i = table[n] = len(self.names)
                self.names.append(n)
            out.append(i)
        return out

    def add_run(self, numbers: Sequence[int], weight: float, job_id: int | None, at: float,
                reason: str, size: int, pinned: bool, started: float | None,
                gpus: int) -> None:
        """A Blame on each node numbered ``numbers`` (`numbers`), with the same fields."""
        if not numbers:
            return
        r = len(self.at)
        self.node.extend(numbers)
        self.run.extend(repeat(r, len(numbers)))
        self.weight.append(weight)
        self.job.append(NO_JOB if job_id is None else job_id)
        self.at.append(at)
        self.reason.append(self._reasons.setdefault(reason, reason))
        self.size.append(size)
        self.pinned.append(pinned)
        self.started.append(math.nan if started is None else started)
        self.gpus.append(gpus)

    def add_runs(self, numbers: Sequence[Sequence[int]], weights: Sequence[float],
                 job_ids: Sequence[int | None], ats: Sequence[float], reasons: Sequence[str],
                 sizes: Sequence[int], pinned: Sequence[bool], started: Sequence[float],
                 gpus: Sequence[int]) -> None:
        """`add_run` of each run, by column (none without nodes; ``started`` all known).
        ``numbers``: lists, or ``array("i")``s, joined at once (`incidence.int32s`); the runs'
        numbers of their blames made by numpy (a generator of them was a second at a year)."""
        if not all(numbers):
            for k, nums in enumerate(numbers):
                self.add_run(nums, weights[k], job_ids[k], ats[k], reasons[k], sizes[k],
                             pinned[k], started[k], gpus[k])
            return
        r = len(self.at)
        self.node.frombytes(int32s(numbers))
        lens = np.fromiter(map(len, numbers), dtype=np.int64, count=len(numbers))
        self.run.frombytes(np.repeat(np.arange(r, r + len(numbers), dtype=np.int32),
                                     lens).tobytes())
        self.weight.extend(weights)
        self.job.extend([NO_JOB if j is None else j for j in job_ids])
        self.at.extend(ats)
        self.reason.extend(map(self._reasons.setdefault, reasons, reasons))
        self.size.extend(sizes)
        self.pinned.extend(pinned)
        self.started.extend(started)
        self.gpus.extend(gpus)

    def append(self, b: Blame) -> None:
        self.add_run(self.numbers((b.node,)), b.weight, b.job_id, b.at, b.reason, b.size,
                     b.pinned, b.started, b.gpus)

    def extend(self, blames: Iterable[Blame]) -> None:
        if not isinstance(blames, Blames):
            for b in blames:
                self.append(b)
            return
        remap = self.numbers(blames.names)
        base = len(self.at)
        self.node.extend(remap[i] for i in blames.node)
        self.run.extend(r + base for r in blames.run)
        self.weight.extend(blames.weight)
        self.job.extend(blames.job)
        self.at.extend(blames.at)
        self.reason.extend(map(self._reasons.setdefault, blames.reason, blames.reason))
        self.size.extend(blames.size)
        self.pinned.extend(blames.pinned)
        self.started.extend(blames.started)
        self.gpus.extend(blames.gpus)

    # -- reading -----------------------------------------------------------------------------

    def _blame(self, i: int) -> Blame:
        return next(self.at_rows((i,)))

    def __len__(self) -> int:
        return len(self.node)

    @overload
    def __getitem__(self, i: int) -> Blame: ...
    @overload
    def __getitem__(self, i: slice) -> list[Blame]: ...
    def __getitem__(self, i: int | slice) -> Blame | list[Blame]:
        if isinstance(i, slice):
            return [self._blame(k) for k in range(len(self))[i]]
        return self._blame(range(len(self))[i])

    def __iter__(self) -> Iterator[Blame]:
        return self.at_rows(range(len(self)))

    def at_rows(self, rows: Iterable[int], reasons: Iterable[str] | None = None
                ) -> Iterator[Blame]:
        """The blames at the places ``rows``, in that order; ``reasons``: theirs instead (one
        per place)."""
        names, node, run = self.names, self.node, self.run
        weight, job, at = self.weight, self.job, self.at
        size, pinned, started, gpus = self.size, self.pinned, self.started, self.gpus
        isnan = math.isnan
        if reasons is None:
            reason = self.reason
            pairs: Iterable[tuple[int, str | None]] = zip(rows, repeat(None))
        else:
            pairs = zip(rows, reasons, strict=True)
        for i, why in pairs:
            r = run[i]
            s = started[r]
            j = job[r]
            yield _make(names[node[i]], weight[r], None if j == NO_JOB else j, at[r],
                        reason[r] if why is None else why, size[r], bool(pinned[r]),
                        None if isnan(s) else s, gpus[r])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Blames({list(self)!r})"

    def __reduce__(self) -> tuple[type, tuple[()], dict[str, object]]:
        return Blames, (), self.__dict__

    def node_codes(self) -> npt.NDArray[np.int64]:
        """Per blame, its node's number (`names`)."""
        return np.frombuffer(self.node, dtype=np.int32).astype(np.int64)

    def runs(self) -> int:
        return len(self.at)

    def run_of(self, i: int) -> int:
        """The run of the blame at place ``i`` (its job, time and reason are the run's)."""
        return self.run[i]

    def lone(self) -> int:
        """Blames without a run (health drains, rule 5)."""
        if not len(self.node):
            return 0
        no_job = np.frombuffer(self.job, dtype=np.int64) == NO_JOB
        return int(no_job[np.frombuffer(self.run, dtype=np.int32)].sum())

    def on_nodes(self, nodes: Iterable[str]) -> Iterator[tuple[str, float | None, float, int,
                                                                int | None]]:
        """(node, started, at, gpus, job id) of each blame on one of ``nodes``, in order."""
        wanted = {self._number[n] for n in nodes if n in self._number}
        if not wanted or not len(self.node):
            return
        codes = np.frombuffer(self.node, dtype=np.int32)
        hits = np.flatnonzero(np.isin(codes, np.fromiter(wanted, dtype=np.int32)))
        names, run, job, at, started, gpus = (self.names, self.run, self.job, self.at,
                                              self.started, self.gpus)
        for i in hits.tolist():
            r = run[i]
            s = started[r]
            j = job[r]
            yield (names[self.node[i]], None if math.isnan(s) else s, at[r], gpus[r],
                   None if j == NO_JOB else j)

    def spans_on(self, nodes: Iterable[str]) -> dict[str, tuple[npt.NDArray[np.float64],
                                                                npt.NDArray[np.float64],
                                                                npt.NDArray[np.int64]]]:
        """Per node of ``nodes`` with a blame of a run (a job id: not a lone drain), its
        blamed runs as arrays in order: (start, else end where not known; end; GPU class):
        what `on_nodes` gives of them, by column (a year's drained nodes hold a million)."""
        wanted = [self._number[n] for n in nodes if n in self._number]
        if not wanted or not len(self.node):
            return {}
        codes = np.frombuffer(self.node, dtype=np.int32)
        hits = np.flatnonzero(np.isin(codes, np.array(wanted, dtype=np.int32)))
        runs = np.frombuffer(self.run, dtype=np.int32)[hits]
        ran = np.frombuffer(self.job, dtype=np.int64)[runs] != NO_JOB
        hits, runs = hits[ran], runs[ran]
        if not len(hits):
            return {}
        at = np.frombuffer(self.at, dtype=np.float64)[runs]
        started = np.frombuffer(self.started, dtype=np.float64)[runs]
        started = np.where(np.isnan(started), at, started)
        gpus = np.frombuffer(self.gpus, dtype=np.int64)[runs]
        mine = codes[hits]
        order = np.argsort(mine, kind="stable")
        mine = mine[order]
        bounds = np.flatnonzero(np.r_[True, mine[1:] != mine[:-1], True])
        names = self.names
        return {names[int(mine[a])]: (started[order[a:b]], at[order[a:b]], gpus[order[a:b]])
                for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)}

    def firsts(self) -> Iterator[Blame]:
        """The first blame of each run, in order: one per failed run a gang's blames share."""
        if not len(self.node):
            return
        run = np.frombuffer(self.run, dtype=np.int32)
        starts = np.flatnonzero(np.r_[True, run[1:] != run[:-1]])
        yield from self.at_rows(starts.tolist())
