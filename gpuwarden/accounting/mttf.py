"""MTTF by job size, its projection to larger jobs, and the checkpoint interval per size. Pure.

A run's failure is one the attribution rules blame on the infrastructure (node failures,
requeues, failed gang jobs, failures on nodes health gating drained); the user's own failures
do not count. MTTF of a size class = its job-hours / its failures.

Two projections to sizes the site has not run:
- from the history's own per-GPU rate (all classes pooled: failures per GPU-hour), times N;
- from the fleet's node failure rate r_f (health-gating drains per node-day, the rate Meta's
  paper projects from): MTTF(N GPUs) = 1 / (N / gpus_per_node * r_f).
Both are "1/N" projections; they differ in which failures they count.

Checkpoint interval (C = checkpoint cost, M = MTTF): Young, sqrt(2CM); Daly's higher-order
form, sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C while C < 2M, else M.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.attribution import GRACE_S, LEAD_S, Attribution, event_time
from gpuwarden.accounting.calibrate import BIG_GPUS, PaperFigures
from gpuwarden.accounting.readspan import human_span
from gpuwarden.accounting.windows import merged
from gpuwarden.slurm.models import NodeEvent
from gpuwarden.slurm.reasons import is_health_drain


@dataclass(frozen=True)
class SizeClass:
    gpus: int  # the class holds runs of gpus/2 < n <= gpus GPUs
    runs: int
    hours: float
    failures: int
    mttf_h: float | None  # None: no failure seen, so no estimate
    young_h: float | None
    daly_h: float | None
    paper_mttf_h: float | None = None  # Meta's, where the paper gives one for this size
    gpu_hours: float = 0.0  # GPUs x hours of the class's runs (its mean GPUs: / hours)

    @property
    def failure_rate(self) -> float:
        return self.failures / self.runs if self.runs else 0.0


@dataclass(frozen=True)
class Projection:
    gpus: int
    from_history_h: float | None
    from_node_rate_h: float | None
    paper_h: float | None = None  # Meta's projection, where the paper gives one


@dataclass(frozen=True)
class MttfReport:
    classes: tuple[SizeClass, ...]
    gpu_hours: float
    failures: int
    per_gpu_mttf_h: float | None
    node_failures: int
    node_days: float
    node_rate: float | None  # r_f, failures per node-day
    projections: tuple[Projection, ...]
    ckpt_cost_s: float
    span_days: float = 0.0
    insufficient: str = ""  # why the projections are withheld, and the history they need
    # Runs and failures of the classes from BIG_GPUS up: the paper's ">=512-GPU jobs" (the
    # 512 class holds runs of 257 to 512 GPUs).
    big_runs: int = 0
    big_failures: int = 0
    paper: PaperFigures = field(default_factory=PaperFigures)
    # The node_failures (health-gating drains) by what they did to jobs (`drain_runs`): came
    # with a failed run counted in the table (that run is the job failure, counted once), with
    # one accounting has no GPUs for (not in the table), or with no failed run at all.
    drains_with_failed_run: int = 0
    drains_without_gpus: int = 0
    drains_no_failed_run: int = 0
    drains_note: str = ""  # the same, said
    # Runs accounting has no GPUs for, and those of them blamed on the infrastructure: left
    # out of the classes (AccountingStorageTRES without gres/gpu records none).
    gpuless_runs: int = 0
    gpuless_failures: int = 0


MIN_FAILURES = 10  # below this a rate's error is over +-30%: no projection is made from it


def history_needed(failures: int, span_days: float) -> str:
    """What to say when too few failures were seen to project from. Job failures: the
    health-gating drains that interrupted no run are node failures, said apart
    (`drains_note`)."""
    span = human_span(span_days * 86_400)
    if failures == 0:
        more = f"more than {human_span(MIN_FAILURES / 3 * span_days * 86_400)}" \
            if span_days > 0 else "weeks to months"
        return (f"insufficient data: no job failure blamed on the infrastructure in {span} "
                f"of history; a projection needs at least {MIN_FAILURES} ({more} at this "
                "rate)")
    need = human_span(MIN_FAILURES / failures * span_days * 86_400)
    return (f"insufficient data: {failures} job failure(s) blamed on the infrastructure in "
            f"{span} of history; a projection needs at least {MIN_FAILURES}, about {need} "
            "at this rate")


def class_mttf_h(att: Attribution) -> dict[int, float]:
    """MTTF (hours) of each size class with a failure, by its GPUs (a class holds runs of
    gpus/2 < n <= gpus GPUs): its job-hours / its failures. A class with none has no estimate
    and is left out."""
    return {g: att.gpu_hours.get(g, 0.0) / att.gpu_failures[g]
            for g in sorted(att.gpu_runs) if g > 0 and att.gpu_failures.get(g, 0) > 0}


def young(cost_h: float, mttf_h: float) -> float:
    return math.sqrt(2 * cost_h * mttf_h)


def daly(cost_h: float, mttf_h: float) -> float:
    if cost_h >= 2 * mttf_h:
        return mttf_h
    x = cost_h / (2 * mttf_h)
    return math.sqrt(2 * cost_h * mttf_h) * (1 + math.sqrt(x) / 3 + x / 9) - cost_h


def gating_drain_events(events: Iterable[NodeEvent], since: float = 0.0,
                        until: float = float("inf")) -> Iterator[tuple[NodeEvent, float]]:
    """(event, start) of each health-gating drain that began in [since, until] (lemon drains
    and operators' drains, `gpuwarden drain` by hand included, are not node failures; a
    drain that began before the history did is not its failure)."""
    for e in events:
        if not is_health_drain(e.reason):  # tagged by health gating; not a hand drain
            continue
        if "DRAIN" not in e.state.upper():
            continue
        at = event_time(e.start)
        if at is not None and since <= at <= until:
            yield e, at


def gating_drains(events: Iterable[NodeEvent], since: float = 0.0,
                  until: float = float("inf")) -> Iterator[tuple[str, float]]:
    """(node, start) of each `gating_drain_events` drain."""
    for e, at in gating_drain_events(events, since, until):
        yield e.node, at


def node_failures(events: Iterable[NodeEvent], since: float = 0.0,
                  until: float = float("inf")) -> int:
    """How many `gating_drains` there are: the node failures r_f counts."""
    return sum(1 for _ in gating_drains(events, since, until))


def drained_nodes(events: Iterable[NodeEvent]) -> frozenset[str]:
    """The nodes with a health-gating drain: whose blames `drain_runs` reads, the only ones
    `report` reads (`Attribution.blames_on`)."""
    return frozenset(e.node for e in events if is_health_drain(e.reason))


def drain_runs(att: Attribution, events: Iterable[NodeEvent],
               spans: Sequence[tuple[float, float]],
               grace_s: float = GRACE_S) -> Iterator[tuple[NodeEvent, float, int | None]]:
    """(event, start, GPU class of the failed run it came with, None for none) of each
    `gating_drain_events` drain in ``spans``. A drain came with a failed run when it began
    from just before that run started to ``grace_s`` after it ended, on one of the nodes the
    run was blamed on: the attribution's test (rules 4 and 5), so that run is the job failure
    and the drain is not counted a second time."""
    events = list(events)
    drained = drained_nodes(events)  # the nodes looked up
    near = {node: _Runs.of(*cols) for node, cols in att.blames.spans_on(drained).items()}
    for lo, hi in spans:
        for e, at in gating_drain_events(events, lo, hi):
            got = near.get(e.node)
            hits = got.around(at, grace_s) if got is not None else []
            yield e, at, (max(hits) if hits else None)


class _Runs:
    """One node's blamed runs by start, to find those around a drain by bisection: each drain
    looked at every run of its node, 40 of a year's report's 390 seconds."""

    def __init__(self, runs: list[tuple[float, float, int]]) -> None:
        runs.sort(key=lambda r: r[0])
        self.runs = runs
        self.starts = [r[0] for r in runs]
        self.longest = max((end - s for s, end, _ in runs), default=0.0)

    @classmethod
    def of(cls, started: npt.NDArray[np.float64], ended: npt.NDArray[np.float64],
           gpus: npt.NDArray[np.int64]) -> _Runs:
        """The runs (start, end, GPU class) of these columns (`Blames.spans_on`'s), by numpy:
        in the same order (a stable sort by start)."""
        order = np.argsort(started, kind="stable")
        out = cls.__new__(cls)
        starts = started[order]
        out.starts = starts.tolist()
        out.runs = list(zip(out.starts, ended[order].tolist(), gpus[order].tolist(),
                            strict=True))
        out.longest = float((ended - started).max()) if len(started) else 0.0
        return out

    def around(self, at: float, grace_s: float) -> list[int]:
        """The GPU classes of the runs with start - LEAD_S <= at <= end + grace_s: a run that
        ends late enough started at most ``longest`` before its end."""
        i = bisect_left(self.starts, at - grace_s - self.longest)
        j = bisect_right(self.starts, at + LEAD_S)
        return [g for s, end, g in self.runs[i:j] if s - LEAD_S <= at <= end + grace_s]


def drains_note(with_run: int, without_gpus: int, no_run: int) -> str:
    """How the health-gating drains count, in one sentence: all as node failures (r_f); as
    job failures only through the failed run each came with."""
    total = with_run + without_gpus + no_run
    if not total:
        return "no health-gating drains in this history"
    out = (f"{total} health-gating drains: {total} counted as node failures (r_f); counted as "
           f"job failures: {with_run}")
    if with_run:
        out += (" (the failed run it came with, counted once in the MTTF table)" if with_run == 1
                else " (the failed runs they came with, each counted once in the MTTF table)")
    if no_run:
        out += (f"; not counted as job failures: {no_run}, no run failed with them (they "
                "interrupted no job)")
    if without_gpus:
        out += (f"; not counted as job failures: {without_gpus}, the run that failed with them "
                "has no GPUs in accounting (Slurm records them only with "
                "AccountingStorageTRES=gres/gpu; runs without GPUs are left out of the table)")
    return out


# Meta's published figures (Kokolis et al., "Revisiting Reliability in Large-Scale ML Research
# Clusters", 2024), carried in a report so that its readers see them beside the site's own.
def paper_mttf_h(gpus: int, fig: PaperFigures) -> float | None:
    """The paper's MTTF of jobs of ``gpus`` GPUs (hours), where it gives one."""
    return {8: fig.mttf_8gpu_days * 24, 1024: fig.mttf_1024gpu_h}.get(gpus)


def paper_projection_h(gpus: int, fig: PaperFigures) -> float | None:
    """The paper's projected MTTF at ``gpus`` GPUs (hours), where it gives one."""
    return {16_384: fig.projection_16k_h, 131_072: fig.projection_131k_h}.get(gpus)


def report(att: Attribution, events: Sequence[NodeEvent], gpus_per_node: int,
           ckpt_cost_s: float, project_to: Sequence[int],
           paper: PaperFigures | None = None,
           windows: Sequence[tuple[float, float]] = (),
           grace_s: float = GRACE_S,
           drains: Sequence[tuple[NodeEvent, float, int | None]] | None = None) -> MttfReport:
    """``windows``: the accounting read (`History.windows`), where known: the spans the node
    failures are counted in and node-days measured over (a day missing between exports is
    in neither). Without them, the runs' first start to last end (a long run that started
    before the export stretches it). ``drains``: `drain_runs` of these, where the caller read
    them already (the report's health card reads the same)."""
    cost_h = ckpt_cost_s / 3600
    fig = paper or PaperFigures()
    classes = []
    mttfs = class_mttf_h(att)
    for g in sorted(k for k in att.gpu_runs if k > 0):
        hours, fails = att.gpu_hours.get(g, 0.0), att.gpu_failures.get(g, 0)
        m = mttfs.get(g)
        classes.append(SizeClass(g, att.gpu_runs[g], hours, fails, m,
                                 young(cost_h, m) if m else None,
                                 daly(cost_h, m) if m else None, paper_mttf_h(g, fig),
                                 att.class_gpu_hours.get(g, 0.0)))
    big = [c for c in classes if c.gpus >= BIG_GPUS]
    gpu_hours = att.gpu_hours_total
    failures = sum(c.failures for c in classes)
    spans = merged(windows) if windows else ((att.first_start, att.last_end),)
    span_days = max(0.0, sum(hi - lo for lo, hi in spans)) / 86_400
    enough = failures >= MIN_FAILURES
    per_gpu = gpu_hours / failures if failures else None
    node_days = span_days * len(att.exposure)
    came = [g for _, _, g in (drain_runs(att, events, spans, grace_s) if drains is None
                              else drains)]
    nf = len(came)
    split = (sum(g is not None and g > 0 for g in came), sum(g == 0 for g in came),
             sum(g is None for g in came))
    rate = nf / node_days if node_days and nf >= MIN_FAILURES else None
    projections = tuple(
        Projection(n, per_gpu / n if per_gpu and enough else None,
                   24 / (n / gpus_per_node * rate) if rate else None,
                   paper_projection_h(n, fig))
        for n in project_to)
    return MttfReport(tuple(classes), gpu_hours, failures, per_gpu, nf, node_days, rate,
                      projections, ckpt_cost_s, span_days,
                      "" if enough else history_needed(failures, span_days),
                      sum(c.runs for c in big), sum(c.failures for c in big), fig, *split,
                      drains_note(*split), att.gpu_runs.get(0, 0), att.gpu_failures.get(0, 0))


def human_hours(h: float | None) -> str:
    if h is None:
        return "-"
    if h >= 48:
        return f"{h / 24:.1f} d"
    if h >= 1:
        return f"{h:.1f} h"
    return f"{h * 60:.1f} min"
