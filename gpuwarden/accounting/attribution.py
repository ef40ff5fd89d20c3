"""Which failures count against which node. Pure; every rule is documented here and tested.

Rules (one accounting record = one run of a job; requeued jobs have several):

1. NODE_FAIL and BOOT_FAIL: Slurm itself saw the node fail. Blame every node of the run,
   1/k each for a k-node run.
2. REQUEUED, with a failure event of one of its nodes (see below): Slurm requeued the job
   after that node failed or failed its prolog (a health-gating prolog drains first). A requeue
   with no such event is an operator's `scontrol requeue` or the job's own (RequeueExit):
   never blamed.
3. FAILED on k > 1 nodes: a gang job died; the cause is on one of its nodes, so blame is
   spread, 1/k each. A node that causes many such failures accumulates blame quickly.
4. FAILED on one node: the user's, unless health gating drained that node (a reason tagged
   `[health]`, which only health gating writes) while the job ran or within `grace_s` after;
   then the node takes the whole blame.
5. A health-gating drain not already explained by a run blamed under rules 1-4 on the same node
   within `grace_s` counts as one failure of its own.
   In rules 1-3, when some nodes of the run have a failure event of their own in
   `sacctmgr show events` from `LEAD_S` before the run ended to `grace_s` after, the blame goes
   to those nodes alone, 1/m each: the events name the node that went down, and blaming its
   innocent neighbours would hide it among them. A failure event is a health-gating drain or a
   DOWN for one of Slurm's own reasons (`SLURM_DOWN_REASONS`); an operator's down or drain is
   not one.
6. Never blamed on a node: COMPLETED, CANCELLED, TIMEOUT, OUT_OF_MEMORY, PREEMPTED, DEADLINE
   (the user's or the scheduler's doing), nor any state not named above.
7. A repaired lemon starts clean: once a lemon drain has ended (an operator resumed the node),
   runs on that node that ended before then no longer count for it, nor against it.
8. One failure event explains at most one failed run: a node that went down between two runs
   (near the end of one and the start of the next, both within the windows above) is the
   culprit (rules 1-3) or the drain (rule 4) of the run whose end is nearest the event; on a
   tie, of the run that ended at or before it. The other runs are judged as if the event had
   not happened. Runs that claim an event wait (`Attribution.pending`) until every batch has
   been read (`add_lone_drains`), so the owner does not depend on the order runs are read.

The 1/k weights are the evidence listing only: which node of a failed run is to blame is
decided by the joint fit over every run (`gpuwarden.lemon.inference`), from the incidence this
module fills (`Attribution.incidence`). In rule 1, sacct's `failed_node` names the node when
no event does.

Exposure: every run with nodes and start/end times adds one job and its hours to each node,
filed by the run's size (node count, in powers of two), because big runs fail more often and a
node's expected failures depend on the sizes of the runs it took part in. Its node-hours also go
to its user and its job script (`IncidenceBuilder.add_source_hours`): a source's share of the
fleet's runs is what its share of a node's failures is measured against. A run lasts at least
a second (`MIN_RUN_S`, sacct's resolution), so one that failed at launch still counts.
Records that are malformed or partial are counted as skipped, with why, and never stop the scan.
Partial results from separate files merge (`Attribution.merge`), so a long history can be read
in pieces, in parallel.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from itertools import accumulate

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.blames import Blame, Blames
from gpuwarden.accounting.columns import Columns
from gpuwarden.accounting.incidence import IncidenceBuilder, places
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.stream import AcctRecord
from gpuwarden.accounting.submit import ALL_NODES, named_nodes, script_key
from gpuwarden.accounting.windows import inside
from gpuwarden.slurm.hostlist import HostlistError, expand
from gpuwarden.slurm.hostranges import shape
from gpuwarden.slurm.models import REASON_PREFIX, NodeEvent
from gpuwarden.slurm.reasons import is_health_drain

NODE_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL"})
LEMON_PREFIX = f"{REASON_PREFIX} lemon"
GRACE_S = 3600.0
LEAD_S = 300.0  # a run ends NODE_FAIL a little after its node stopped answering
# sacct records whole seconds: a run it shows as 0 s ran for up to a second. Counted as 0, a
# node whose jobs all die at launch had no exposure, so the fit could not give it a rate and
# put its failures on its healthy neighbours.
MIN_RUN_S = 1


def run_seconds(start: int, end: int) -> int:
    """A run's exposure: its recorded length, at least sacct's resolution."""
    return max(end - start, MIN_RUN_S)


@dataclass
class Exposure:
    jobs: int = 0
    # Whole seconds (sacct's resolution), so the total does not depend on the order runs
    # were added in (files, workers, the accounting store's groups): `hours` is exact.
    seconds: int = 0
    by_size: Counter[int] = field(default_factory=Counter)

    @property
    def hours(self) -> float:
        return self.seconds / 3600


@dataclass
class Attribution:
    # Built as columns (`Blames`); a list of Blame given is made into them.
    blames: Blames = field(default_factory=Blames)
    exposure: dict[str, Exposure] = field(default_factory=lambda: defaultdict(Exposure))
    skipped: Counter[str] = field(default_factory=Counter)
    runs_by_size: Counter[int] = field(default_factory=Counter)   # node-runs per bucket
    # Blamed node-runs per bucket: pinned on the node, or spread over a gang job's nodes.
    pinned_by_size: Counter[int] = field(default_factory=Counter)
    spread_by_size: Counter[int] = field(default_factory=Counter)
    # Per GPU-count class (powers of two): runs, job-hours, runs blamed on the infrastructure.
    gpu_runs: Counter[int] = field(default_factory=Counter)
    gpu_hours: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    gpu_failures: Counter[int] = field(default_factory=Counter)
    # Per GPU-count class, GPUs x hours, exact (the classes round GPU counts up).
    class_gpu_hours: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    first_start: float = float("inf")
    first_end: float = float("inf")  # the earliest end of a run counted
    last_end: float = 0.0
    # The failed runs x nodes, for the joint inference (`gpuwarden.lemon.inference`).
    incidence: IncidenceBuilder = field(default_factory=IncidenceBuilder)
    # Failed runs that claim a failure event another run may claim too (rule 8): judged once
    # every batch is in (`settle`).
    pending: list[Pending] = field(default_factory=list)
    # None: every blame, the incidence and the sources' hours (what the lemon scoring reads).
    # A set of nodes: only the blames on those nodes are kept, and nothing of the incidence;
    # every count above is the same. `fleet mttf` reads no more than the blames of the nodes
    # health gating drained (`mttf.drained_nodes`), and making the rest was most of its read.
    blames_on: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.blames, Blames):
            self.blames = Blames(self.blames)

    @property
    def gpu_hours_total(self) -> float:
        """GPUs x hours of every run."""
        return sum(self.class_gpu_hours.values())

    def merge(self, other: Attribution) -> Attribution:
        self.blames.extend(other.blames)
        for node, e in other.exposure.items():
            mine = self.exposure[node]
            mine.jobs += e.jobs
            mine.seconds += e.seconds
            mine.by_size.update(e.by_size)
        self.skipped.update(other.skipped)
        self.runs_by_size.update(other.runs_by_size)
        self.pinned_by_size.update(other.pinned_by_size)
        self.spread_by_size.update(other.spread_by_size)
        self.gpu_runs.update(other.gpu_runs)
        for g, h in other.gpu_hours.items():
            self.gpu_hours[g] += h
        self.gpu_failures.update(other.gpu_failures)
        for g, h in other.class_gpu_hours.items():
            self.class_gpu_hours[g] += h
        self.first_start = min(self.first_start, other.first_start)
        self.first_end = min(self.first_end, other.first_end)
        self.last_end = max(self.last_end, other.last_end)
        self.incidence.merge(other.incidence)
        self.pending.extend(other.pending)
        return self


@dataclass(frozen=True)
class HealthDrain:
    node: str
    at: float
    reason: str


@dataclass(frozen=True)
class Held:
    """What judging a failed run reads of its record (kept while it waits, rule 8)."""

    job_id: int
    user: str
    state: str
    exit_code: int | None
    failed_node: str
    submit_line: str


@dataclass(frozen=True)
class Pending:
    """A failed run waiting for the events it claims to be shared out (rule 8)."""

    job: Held
    all_nodes: tuple[str, ...]
    nodes: tuple[str, ...]
    start: int
    end: int
    size: int
    gclass: int
    claims: tuple[HealthDrain, ...]  # every event it could use
    drained: tuple[HealthDrain, ...] = ()  # of those, the health drains rule 4 reads


def size_bucket(nodes: int) -> int:
    """1 for one node, 2 for 2, 3 for 3-4, 4 for 5-8, ...: powers of two."""
    return max(1, (nodes - 1).bit_length() + 1)


def gpu_class(gpus: int) -> int:
    """The power of two at or above ``gpus`` (0 for a run without GPUs)."""
    return 0 if gpus <= 0 else 1 << (gpus - 1).bit_length()


# Event times read so far, by their text: a report reads each event's times several times
# (drains, failures, lemon clears, the tally's filter, the MTTF read), a year's ~100k events
# each a parse. Emptied when full, so a long-lived reader's stays bounded (~15 MB).
_TIMES: dict[str, float | None] = {}
_TIMES_MAX = 1 << 17


def event_time(text: str) -> float | None:
    """An event time as `sacctmgr` prints it under TZ=UTC (gpuwarden's client sets it; export
    with `TZ=UTC sacctmgr ...`); None for "Unknown" (still open) or anything unreadable."""
    try:
        return _TIMES[text]
    except KeyError:
        pass
    if len(_TIMES) >= _TIMES_MAX:
        _TIMES.clear()
    got = _TIMES[text] = _parse_time(text)
    return got


_EPOCH = datetime(1970, 1, 1)


def _parse_time(text: str) -> float | None:
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return None
    # A naive time is UTC: its distance from the naive epoch is what `timestamp()` of it made
    # aware gives (the same subtraction, in seconds), at a sixth of the cost.
    return (at - _EPOCH).total_seconds() if at.tzinfo is None else at.timestamp()


def health_drains(events: Iterable[NodeEvent]) -> list[HealthDrain]:
    """Drains set by health gating, from `sacctmgr show events` (lemon drains excluded)."""
    out = []
    for e in events:
        # Only health gating's own drains (tagged): a hand `gpuwarden drain --reason` is an
        # operator's, not evidence of a fault.
        if not e.node or not is_health_drain(e.reason):
            continue
        at = event_time(e.start)
        if at is not None:
            out.append(HealthDrain(e.node, at, e.reason))
    return out


# The reasons slurmctld itself gives a node it sets DOWN or DRAIN (src/slurmctld); anything else
# was typed by a person.
SLURM_DOWN_REASONS = (
    "Not responding", "Kill task failed", "Prolog error", "Epilog error",
    "Node unexpectedly rebooted", "batch job complete failure", "NO NETWORK ADDRESS FOUND",
    "Low RealMemory", "Low TmpDisk", "Low socket*core*thread count", "Low CPUs",
    "Duplicate jobid", "Job credential expired", "SlurmdSpoolDir is full",
    "Node silently failed and came back", "Health check failed",
)


def node_failures(events: Iterable[NodeEvent]) -> list[HealthDrain]:
    """A node's own failure events: health-gating drains (not lemon drains) and Slurm's own
    downs; never an operator's down or drain."""
    out = []
    for e in events:
        if not e.node:
            continue
        if is_health_drain(e.reason) or e.reason.startswith(SLURM_DOWN_REASONS):
            at = event_time(e.start)
            if at is not None:
                out.append(HealthDrain(e.node, at, e.reason))
    return out


def lemon_clears(events: Iterable[NodeEvent]) -> dict[str, float]:
    """Per node, when its last lemon drain ended (rule 7)."""
    out: dict[str, float] = {}
    for e in events:
        if e.node and e.reason.startswith(LEMON_PREFIX):
            end = event_time(e.end)
            if end is not None and end > out.get(e.node, 0.0):
                out[e.node] = end
    return out


@lru_cache(maxsize=65_536)
def _expand(nodes: str) -> tuple[str, ...]:
    # Big jobs repeat the same node lists; expanding each once matters at millions of records.
    return tuple(expand(nodes))


@lru_cache(maxsize=65_536)
def _submit_facts(line: str) -> tuple[frozenset[str], str]:
    # shlex is ~100 us a line, and failed runs repeat their submit lines (retries, arrays).
    return named_nodes(line), script_key(line)


def _nodes(job: AcctRecord) -> tuple[str, ...]:
    if not job.nodes or job.nodes in ("None assigned", "(null)"):
        return ()
    return _expand(job.nodes)


def by_node(drains: Iterable[HealthDrain]) -> dict[str, list[HealthDrain]]:
    out: dict[str, list[HealthDrain]] = defaultdict(list)
    for d in drains:
        out[d.node].append(d)
    for ds in out.values():
        ds.sort(key=lambda d: d.at)
    return out


def _failed_nodes(nodes: tuple[str, ...], end: int, failures: Mapping[str, list[HealthDrain]],
                  grace_s: float) -> list[str]:
    if len(failures) < len(nodes):
        # A pending run's own events (`settle`): a node or two of a gang of dozens.
        near = {n for n, ds in failures.items()
                if any(end - LEAD_S <= d.at <= end + grace_s for d in ds)}
        return in_order(nodes, near) if near else []
    hit = []
    for n in nodes:
        ds = failures.get(n)
        if ds and any(end - LEAD_S <= d.at <= end + grace_s for d in ds):
            hit.append(n)
    return hit


def in_order(nodes: tuple[str, ...], few: Set[str]) -> list[str]:
    """``[n for n in nodes if n in few]``, by a scan of ``nodes`` for each of ``few``
    (`incidence.places`) where they are a few of many: a gang's one or two culprits were a
    look at each of its nodes (`settle`'s 105k runs of a year, 5.4M nodes)."""
    if len(few) > 4 or len(nodes) < 16:
        return [n for n in nodes if n in few]
    return [n for _, n in sorted(places(nodes, few))]


def attribute_runs(jobs: Iterable[AcctRecord] | Columns,
                   drains: Mapping[str, list[HealthDrain]],
                   grace_s: float = GRACE_S,
                   clears: Mapping[str, float] | None = None,
                   failures: Mapping[str, list[HealthDrain]] | None = None,
                   into: Attribution | None = None,
                   tally: RangeTally | None = None, *, grouped: bool = True) -> Attribution:
    """Rules 1-4, 6 and 7 over one batch of records; mergeable with other batches.

    ``drains``: health-gating drains by node; ``failures``: every node failure event by node
    (DOWN and health drains), to pin a run's failure on the nodes that failed. ``into``: add
    to this Attribution rather than a new one. ``tally``: leave the exposure of runs in it, for
    the caller to `spread_exposure` once after many batches (by default, spread at the end).
    ``grouped``: False judges every record on its own (`_attribute_one`), the reference the
    grouped path is tested against (tests/unit/test_attribution_grouped.py).
    """
    result = into if into is not None else Attribution()
    clears = clears or {}
    failures = drains if failures is None else failures
    cols = jobs if isinstance(jobs, Columns) else Columns(list(jobs))
    # Exposure goes to a tally of node ranges, spread over the nodes once at the end: at
    # millions of records, naming and touching every node of every run dominated the scan.
    ranged = RangeTally() if tally is None else tally
    records = cols.records
    if not grouped:
        for i in range(len(records)):
            _attribute_one(result, records[i], cols, i, drains, failures, clears, grace_s, ranged)
    else:
        for i in _add_plain(result, cols, clears, ranged):
            _attribute_one(result, records[i], cols, i, drains, failures, clears, grace_s, ranged)
    if tally is None:
        spread_exposure(result.exposure, ranged)
    return result


def meets_cleared(text: str, clears: Mapping[str, float]) -> bool:
    """Whether a node list names a node whose lemon drain was cleared (rule 7: its runs are
    judged one by one); True for a list too long to expand."""
    return _meets(text, clears)


def _meets(text: str, clears: Mapping[str, float]) -> bool:
    """Whether a node list names a node whose lemon drain was cleared; True for a list too
    long to expand, so the record goes the one-by-one way (skipped as unreadable)."""
    try:
        return any(n in clears for n in _expand(text))
    except HostlistError:
        return True


def _add_plain(result: Attribution, cols: Columns, clears: Mapping[str, float],
               ranged: RangeTally) -> list[int]:
    """The runs rules 1-4 never blame (most of them), tallied by node list and by GPU count:
    what `_attribute_one` adds for each, added once per list and per count. Returns the other
    records' places, in order: a state that may be blamed, a missing time, a node list
    `shape` does not read or with a node whose lemon drain was cleared (rule 7)."""
    by_list: dict[str, list[int]] = {}
    by_gpus: dict[int, list[int]] = {}
    by_source: dict[tuple[str, str], int] = {}  # node-seconds per (user, submit line)
    others: list[int] = []
    first, first_end, last = result.first_start, result.first_end, result.last_end
    blamable, other = _BLAMABLE, _OTHER
    for i, (text, shaped, state, start, end, gpus, user, line) in enumerate(zip(
            cols.nodes, cols.shaped, cols.states, cols.starts, cols.ends, cols.gpus,
            cols.users, cols.submits, strict=True)):
        if not shaped or state in blamable or not (start and end) or end < start:
            others.append(i)
            continue
        acc = by_list.get(text)
        if acc is None:
            acc = by_list[text] = other if clears and _meets(text, clears) else [
                0, 0, _count(text)]
        if acc is other:
            others.append(i)
            continue
        # Comparisons, not min/max: a call per record costs more than the rest of the step.
        secs = end - start
        if secs < MIN_RUN_S:  # noqa: PLR1730
            secs = MIN_RUN_S
        if start < first:  # noqa: PLR1730
            first = start
        if end > last:  # noqa: PLR1730
            last = end
        if end < first_end:  # noqa: PLR1730
            first_end = end
        acc[0] += 1
        acc[1] += secs
        key = (user, line)
        by_source[key] = by_source.get(key, 0) + secs * acc[2]
        g = by_gpus.get(gpus)
        if g is None:
            by_gpus[gpus] = [1, secs]
        else:
            g[0] += 1
            g[1] += secs
    result.first_start, result.first_end, result.last_end = first, first_end, last
    add_plain_groups(result, ((t, a) for t, a in by_list.items() if a is not other),
                     by_gpus.items(), ranged, by_source.items())
    return others


def add_plain_groups(result: Attribution, by_list: Iterable[tuple[str, Sequence[int]]],
                     by_gpus: Iterable[tuple[int, Sequence[int]]], ranged: RangeTally,
                     by_source: Iterable[tuple[tuple[str, str], int]] = ()) -> None:
    """Runs no rule blames, tallied by group: ``by_list`` (node list `shape` reads, no node
    with a cleared lemon drain) and ``by_gpus`` (GPU count) each with [runs, run-seconds]
    (`run_seconds` summed; a third item in ``by_list``'s, where the caller has it: the
    list's node count), ``by_source`` node-seconds per (user, submit line). What
    `_attribute_one` adds for each of those runs; the caller keeps first_start/first_end/
    last_end. The accounting store's reader tallies the groups on columns and hands them here
    (`accounting.store.scan`)."""
    full = result.blames_on is None
    for text, acc in by_list:
        runs, secs = acc[0], acc[1]
        count = acc[2] if len(acc) > 2 else _count(text)
        size = size_bucket(count)
        result.runs_by_size[size] += count * runs
        if full:
            result.incidence.add_hours(size, secs / 3600)
        ranged.add_list(text, size, secs, runs)
    for gpus, (runs, secs) in by_gpus:
        gclass, hours = gpu_class(gpus), secs / 3600
        result.gpu_runs[gclass] += runs
        result.gpu_hours[gclass] += hours
        result.class_gpu_hours[gclass] += hours * max(0, gpus)
    for (user, line), node_secs in by_source if full else ():
        result.incidence.add_source_hours(user, _submit_facts(line)[1], node_secs / 3600)


def add_plain_sizes(result: Attribution, by_size: Iterable[tuple[int, int, int]]) -> None:
    """`add_plain_groups`' per-list sums, summed by size bucket (the caller spreads the
    exposure): (size, node-runs, run-seconds)."""
    for size, node_runs, secs in by_size:
        result.runs_by_size[size] += node_runs
        if result.blames_on is None:
            result.incidence.add_hours(size, secs / 3600)


def _count(text: str) -> int:
    known = shape(text)
    assert known is not None, text  # the caller checked
    return known[1]


_OTHER: list[int] = []  # a node list with a cleared node: each of its runs on its own


def _attribute_one(result: Attribution, job: AcctRecord, cols: Columns, i: int,
                   drains: Mapping[str, list[HealthDrain]],
                   failures: Mapping[str, list[HealthDrain]], clears: Mapping[str, float],
                   grace_s: float, ranged: RangeTally) -> None:
    """One record: its exposure, and rules 1-4, 6 and 7."""
    text, state = cols.nodes[i], cols.states[i]
    known = None if clears or not text else shape(text)
    all_nodes: tuple[str, ...] = ()
    if known is None or state in _BLAMABLE:
        all_nodes = _named(job, state, result)
        if not all_nodes:
            return
    start, end = job.start_time, job.end_time
    if start is None or end is None or end < start:
        result.skipped["no start or end time"] += 1
        return
    count = known[1] if known is not None else len(all_nodes)
    cleared = bool(clears) and any(n in clears for n in all_nodes)
    nodes = [n for n in all_nodes if end > clears.get(n, 0.0)] if cleared else all_nodes
    secs = run_seconds(start, end)
    hours = secs / 3600
    size = size_bucket(count)
    gpus = job.gpus
    gclass = gpu_class(gpus)
    result.gpu_runs[gclass] += 1
    result.gpu_hours[gclass] += hours
    result.class_gpu_hours[gclass] += hours * max(0, gpus)
    result.first_start = min(result.first_start, start)
    result.first_end = min(result.first_end, end)
    result.last_end = max(result.last_end, end)
    result.runs_by_size[size] += len(nodes) if cleared else count
    if result.blames_on is None:
        result.incidence.add_hours(size, hours)
        result.incidence.add_source_hours(job.user, _submit_facts(job.submit_line)[1],
                                          hours * (len(nodes) if cleared else count))
    if cleared:
        _expose_each(result.exposure, nodes, size, secs)
    elif known is not None:
        ranged.add_list(text, size, secs)
    else:
        ranged.add_names(all_nodes, size, secs)
    if state in _BLAMABLE:  # else rule 6
        drained, claims = _claims(state, all_nodes, start, end, drains, failures, grace_s)
        if claims:  # rule 8: judged once every run that may claim them is in
            result.pending.append(Pending(
                Held(job.job_id, job.user, state, job.exit_code, job.failed_node,
                     job.submit_line), all_nodes, tuple(nodes), start, end, size, gclass,
                claims, drained))
        else:
            _judge(result, job, all_nodes, nodes, start, end, size, gclass, {}, {}, grace_s)


_BLAMABLE = NODE_STATES | {"REQUEUED", "FAILED"}  # the states _rule can blame


def _named(job: AcctRecord, state: str, result: Attribution) -> tuple[str, ...]:
    """The run's nodes by name; () for none (counted as skipped, with why)."""
    try:
        all_nodes = _nodes(job)
    except HostlistError:
        result.skipped["unreadable node list"] += 1
        return ()
    if not all_nodes and state not in ("PENDING", "CANCELLED"):
        result.skipped["no nodes"] += 1
    return all_nodes


def _expose_each(exposure: dict[str, Exposure], nodes: Sequence[str], size: int,
                 secs: int) -> None:
    for n in nodes:
        e = exposure[n]
        e.jobs += 1
        e.seconds += secs
        e.by_size[size] += 1


def _claims(state: str, nodes: tuple[str, ...], start: int, end: int,
            drains: Mapping[str, list[HealthDrain]], failures: Mapping[str, list[HealthDrain]],
            grace_s: float) -> tuple[tuple[HealthDrain, ...], tuple[HealthDrain, ...]]:
    """(rule 4's drains, every event) a failed run could use: its nodes' failures around
    its end (rules 1-3, culprits) and, for one node that FAILED, health drains while it ran or
    after (rule 4)."""
    drained: list[HealthDrain] = []
    if state == "FAILED" and len(nodes) == 1:
        drained = [d for d in drains.get(nodes[0], ()) if start <= d.at <= end + grace_s]
        if not drained:
            return (), ()  # the user's failure (rule 4): no event can change that
    out = list(drained)
    for n in nodes:
        ds = failures.get(n)
        if ds:
            out.extend(d for d in ds if end - LEAD_S <= d.at <= end + grace_s and d not in out)
    return tuple(drained), tuple(out)


def _distance(p: Pending, d: HealthDrain) -> tuple[float, bool, int, int]:
    # Nearest end first; on a tie the run that ended at or before the event; then a fixed
    # order, so that the owner never depends on the order runs were read in.
    return abs(p.end - d.at), p.end > d.at, p.job.job_id, p.start


def settle(att: Attribution, grace_s: float = GRACE_S) -> Attribution:
    """Rule 8, once every batch has been merged: each pending run is judged on the events
    it is the nearest run to."""
    owner: dict[HealthDrain, Pending] = {}
    for p in att.pending:
        for d in p.claims:
            best = owner.get(d)
            if best is None or _distance(p, d) < _distance(best, d):
                owner[d] = p
    for p in att.pending:
        mine = [d for d in p.claims if owner[d] is p]
        _judge(att, p.job, p.all_nodes, p.nodes, p.start, p.end, p.size, p.gclass,
               by_node(d for d in mine if d in p.drained), by_node(mine), grace_s)
    att.pending = []
    return att


def _judge(result: Attribution, job: AcctRecord | Held, all_nodes: tuple[str, ...],
           nodes: Sequence[str], start: int, end: int, size: int, gclass: int,
           drains: Mapping[str, list[HealthDrain]], failures: Mapping[str, list[HealthDrain]],
           grace_s: float) -> None:
    reason = _rule(job, all_nodes, drains, grace_s, start, end)
    if reason is not None and job.state == "REQUEUED" and not (
            failures and _failed_nodes(all_nodes, end, failures, grace_s)):
        reason = None  # rule 2: a requeue no node failure explains
    if reason is not None:
        result.gpu_failures[gclass] += 1
        _blame(result, job, all_nodes, nodes, start, end, size, reason, failures, grace_s,
               gclass)


def _blame(result: Attribution, job: AcctRecord | Held, all_nodes: tuple[str, ...],
           in_scope: Sequence[str], start: int, end: int, size: int, reason: str,
           failures: Mapping[str, list[HealthDrain]], grace_s: float, gclass: int) -> None:
    job_id = job.job_id
    culprits = _failed_nodes(all_nodes, end, failures, grace_s) if failures else []
    if culprits:
        reason += f"; {', '.join(culprits[:3])} failed at the time"
    elif job.state in NODE_STATES and job.failed_node in all_nodes:
        culprits = [job.failed_node]  # sacct's own record of the node that failed
        reason += f"; Slurm recorded {job.failed_node} as the node that failed"
    targets = culprits or all_nodes
    blamed = list(targets) if in_scope is all_nodes else [n for n in targets if n in set(in_scope)]
    weight = 1.0 / len(culprits or all_nodes)
    pinned = len(all_nodes) == 1 or bool(culprits)
    (result.pinned_by_size if pinned else result.spread_by_size)[size] += len(blamed)
    keep = result.blames_on
    blames = result.blames
    if keep is not None:
        blames.add_run(blames.numbers(n for n in blamed if n in keep), weight, job_id,
                       float(end), reason, size, pinned, float(start), gclass)
        return
    named, script = _submit_facts(job.submit_line)
    if named:
        named = frozenset(all_nodes) if named == ALL_NODES else named & frozenset(all_nodes)
    result.incidence.add_failure(
        job_id, float(end), run_seconds(start, end) / 3600, size, in_scope, culprits, named, job.user,
        script, gameable=job.state == "FAILED" and not culprits)
    blames.add_run(blames.numbers(blamed), weight, job_id, float(end), reason, size, pinned,
                   float(start), gclass)


def spread_exposure(exposure: dict[str, Exposure], tally: RangeTally) -> None:
    """Move what ``tally`` holds into the per-node exposure (``tally`` is left empty)."""
    add_exposure(exposure, tally.spread())


def add_exposure(exposure: dict[str, Exposure],
                 rows: Iterable[tuple[str, int, int, int]]) -> None:
    """(node, size bucket, runs, run-seconds) into the per-node exposure."""
    for n, size, runs, secs in rows:
        e = exposure[n]
        e.jobs += runs
        e.seconds += secs
        e.by_size[size] += runs


def add_lone_drains(att: Attribution, drains: Mapping[str, list[HealthDrain]],
                    grace_s: float = GRACE_S,
                    clears: Mapping[str, float] | None = None,
                    windows: Sequence[tuple[float, float]] = ()) -> Attribution:
    """Rules 8 (`settle`) and 5, once every batch has been merged. ``windows``: the
    accounting read (`History.windows`); without them, the runs' own span."""
    settle(att, grace_s)
    clears = clears or {}
    # Only a drained node's runs are looked at, by column: millions of blames at fleet scale.
    blamed = att.blames.spans_on(drains)
    none = _Spans(())
    for node, ds in drains.items():
        got = blamed.get(node)
        runs = none if got is None else _Spans.of(got[0] - LEAD_S, got[1] + grace_s)
        for d in ds:
            if d.at <= clears.get(node, 0.0):
                continue
            if not inside(d.at, windows or ((att.first_start, att.last_end),), grace_s):
                continue  # outside the history read (sacctmgr lists events that overlap it)
            if runs.holds(d.at):
                continue  # the drain explains a run already blamed: count it once
            if att.blames_on is None:
                att.incidence.add_failure(None, d.at, 0.0, 0, [node], [node])
            elif node not in att.blames_on:
                continue
            att.blames.append(Blame(node, 1.0, None, d.at, f"health drain: {d.reason}"))
    return att


class _Spans:
    """Closed spans (lo, hi), asked whether any holds a time: by bisection over the starts and
    the largest end so far. Looking at every blamed run of the node for each of its drains
    grew with the square of the history (a year's drained nodes: a dozen times the drains,
    each against a dozen times the runs)."""

    def __init__(self, spans: Sequence[tuple[float, float]]) -> None:
        ordered = sorted(spans)
        self.starts = [lo for lo, _ in ordered]
        self.reach = list(accumulate((hi for _, hi in ordered), max))

    @classmethod
    def of(cls, lo: npt.NDArray[np.float64], hi: npt.NDArray[np.float64]) -> _Spans:
        """The spans ``lo[i]``-``hi[i]``, by numpy: whichever order spans that start together
        take, the largest end so far past them is the same."""
        order = np.argsort(lo, kind="stable")
        out = cls.__new__(cls)
        out.starts = lo[order].tolist()
        out.reach = np.maximum.accumulate(hi[order]).tolist()
        return out

    def holds(self, t: float) -> bool:
        k = bisect_right(self.starts, t)
        return k > 0 and self.reach[k - 1] >= t


def attribute(jobs: Iterable[AcctRecord], drains: Iterable[HealthDrain] = (),
              grace_s: float = GRACE_S, clears: Mapping[str, float] | None = None,
              failures: Iterable[HealthDrain] | None = None) -> Attribution:
    grouped = by_node(drains)
    fails = by_node(failures) if failures is not None else grouped
    return add_lone_drains(attribute_runs(jobs, grouped, grace_s, clears, fails), grouped,
                           grace_s, clears)


def _rule(job: AcctRecord | Held, nodes: tuple[str, ...], drains: Mapping[str, list[HealthDrain]],
          grace_s: float, start: int, end: int) -> str | None:
    state = job.state
    if state in NODE_STATES:
        return f"node failure ({state})"
    if state == "REQUEUED":
        return "requeued after a node or prolog failure"
    if state != "FAILED":
        return None
    if len(nodes) > 1:
        return f"{len(nodes)}-node job failed (exit {job.exit_code})"
    for d in drains.get(nodes[0], ()):
        if start <= d.at <= end + grace_s:
            return f"failed on a node health gating drained ({d.reason})"
    return None
