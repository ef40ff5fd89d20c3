"""What the report needs of each record that the lemon attribution does not keep, tallied in
the same pass over the records (`history.from_files(..., collector=RunTally.factory(...))`).

- Runs per (UTC day of the run's end, partition, Slurm state).
- The runs the attribution may blame on the infrastructure (FAILED, NODE_FAIL, BOOT_FAIL,
  REQUEUED), by (job id, end): once the attribution is settled, the blamed ones are moved to
  "hardware" (`outcomes`), so every figure agrees with the MTTF section.
- With a topology: gang runs (more than one node) within one leaf switch or across leaves, and
  their queue wait (start - submit), by GPU class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache, partial

from gpuwarden.lemon.attribution import gpu_class
from gpuwarden.report.fields import partition, submitted
from gpuwarden.slurm.acctstream import AcctRecord
from gpuwarden.slurm.hostlist import HostlistError, expand

DAY = 86_400
BLAMABLE = frozenset({"NODE_FAIL", "BOOT_FAIL", "REQUEUED", "FAILED"})

Cell = tuple[int, str, str]  # (UTC day number of the end, partition, Slurm state)
GangKey = tuple[int, str]  # (GPU class, "one leaf" | "several leaves" | "unknown")


def run_key(job_id: int, end: int) -> int:
    """A run of a job (a requeued job has several, each with its own end)."""
    return (job_id << 32) | (end & 0xFFFF_FFFF)


@lru_cache(maxsize=65_536)
def _names(nodes: str) -> tuple[str, ...]:
    try:
        return tuple(expand(nodes))
    except HostlistError:
        return ()


class RunTally:
    """Picklable, mergeable: each worker process fills one per file."""

    def __init__(self, leaf_of: Mapping[str, str] | None = None) -> None:
        self.leaf_of = leaf_of
        self.cells: Counter[Cell] = Counter()
        self.blamable: dict[int, tuple[Cell, int]] = {}  # run_key -> (cell, GPUs)
        self.gang_runs: Counter[GangKey] = Counter()
        self.gang_wait_s: Counter[GangKey] = Counter()
        self.gang_waited: Counter[GangKey] = Counter()  # runs with a submit time
        self._shared: dict[Cell, Cell] = {}

    @classmethod
    def factory(cls, leaf_of: Mapping[str, str] | None = None) -> partial[RunTally]:
        return partial(cls, leaf_of)

    def add(self, records: Sequence[AcctRecord]) -> None:
        cells, keep, shared, leaf_of = self.cells, self.blamable, self._shared, self.leaf_of
        for r in records:
            start, end = r.start_time, r.end_time
            if start is None or end is None or end < start:
                continue  # never ran, or no end yet: the attribution skips it too
            state = r.state
            cell = (end // DAY, partition(r), state)
            cells[cell] += 1
            if state in BLAMABLE:
                # One tuple per distinct cell: a million failed runs share a few hundred.
                keep[run_key(r.job_id, end)] = (shared.setdefault(cell, cell), r.gpus)
            if leaf_of is not None:
                nodes = r.nodes
                if "[" in nodes or "," in nodes:
                    self._gang(r, nodes, start)

    def _gang(self, r: AcctRecord, nodes: str, start: int) -> None:
        names = _names(nodes)
        if len(names) < 2 or self.leaf_of is None:
            return
        leaves = {self.leaf_of.get(n) for n in names}
        where = "unknown" if None in leaves else "one leaf" if len(leaves) == 1 \
            else "several leaves"
        key = (gpu_class(r.gpus), where)
        self.gang_runs[key] += 1
        sub = submitted(r)
        if sub is not None and sub <= start:
            self.gang_wait_s[key] += start - sub
            self.gang_waited[key] += 1

    def merge(self, other: RunTally) -> None:
        self.cells.update(other.cells)
        self.blamable.update(other.blamable)
        self.gang_runs.update(other.gang_runs)
        self.gang_wait_s.update(other.gang_wait_s)
        self.gang_waited.update(other.gang_waited)

    def __getstate__(self) -> dict[str, object]:
        # Back from a worker without the topology (the parent has it) nor the sharing memo.
        state = dict(self.__dict__)
        state["leaf_of"], state["_shared"] = None, {}
        return state
