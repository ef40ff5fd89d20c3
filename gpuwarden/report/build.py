"""Every figure of the report, from one History read with a `RunTally` collector. Pure.

The page shows only what is here, and `--json` writes all of it (`as_json`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from gpuwarden.accounting.attribution import gpu_class
from gpuwarden.accounting.gcpause import paused
from gpuwarden.accounting.history import History
from gpuwarden.accounting.mttf import drain_runs
from gpuwarden.accounting.mttf import report as mttf_report
from gpuwarden.accounting.windows import merged
from gpuwarden.health.gatingstate import NodeGating
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report import drains, ettr, lemons, mttfview, outcomes, restarts, tradeoffs
from gpuwarden.report.collect import RunTally
from gpuwarden.report.text import cleaned

try:  # the lemon extra's; without it, the standard library's slower way
    import msgspec
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    msgspec = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Options:
    source: str  # what was read, in words
    gpus_per_node: int = 8
    ckpt_cost_s: float = 30.0
    interval_h: float = 1.0
    restart_h: float = 0.25
    restore_s: float = 300.0  # r0
    spares: int = 1
    swap_h: float = 2 / 60
    grace_s: float = 3600.0
    have_topology: bool = False
    # The same three in seconds, exact as given (the command passes these): they win.
    interval_s: float | None = None
    restart_s: float | None = None
    swap_s: float | None = None

    def assumptions(self) -> ettr.Assumptions:
        def sec(s: float | None, h: float) -> float:
            return s if s is not None else h * 3600
        return ettr.Assumptions(sec(self.interval_s, self.interval_h), self.ckpt_cost_s,
                                sec(self.restart_s, self.restart_h), self.spares,
                                sec(self.swap_s, self.swap_h), self.gpus_per_node,
                                self.restore_s)


@dataclass(frozen=True)
class GatingRow:
    node: str
    note: str


@dataclass(frozen=True)
class Gating:
    available: bool
    note: str
    nodes_read: int = 0
    flagged: list[GatingRow] = field(default_factory=list)


GATING = Gating(False, "needs the live cluster (gpuwarden report --since): whether a node's "
                       "health gating is off or its verdict stale is in the health marker "
                       "gpuwarden keeps in Slurm (the node's Extra field, as `gpuwarden nodes` "
                       "shows it), not in accounting")


def gating_of(nodes: Iterable[NodeGating], at: datetime) -> Gating:
    """What the cluster's nodes' markers say, read at ``at``."""
    read = list(nodes)
    flagged = [GatingRow(g.node, g.note) for g in read if g.note]
    return Gating(True, "from the health marker each node keeps in Slurm (its Extra field, as "
                        f"`gpuwarden nodes` shows it), read {at.strftime('%Y-%m-%dT%H:%M:%SZ')}",
                  len(read), flagged)


@dataclass(frozen=True)
class Report:
    generated: str
    source: str
    records: int
    first: str | None
    last: str | None
    span_days: float
    skipped: dict[str, int]
    mttf: mttfview.MttfSection
    outcomes: outcomes.Outcomes
    ettr: ettr.EttrSection
    tradeoffs: list[tradeoffs.Tradeoff]
    lemons: list[lemons.LemonRow]
    drains: drains.Drains
    gating: Gating
    # What the reader must know before trusting the page (data that cannot say what it should).
    warnings: list[str] = field(default_factory=list)
    window_note: str = ""  # the window read, as `fleet mttf` says it (`History.window_note`)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def failed_runs(tally: RunTally, att: Any, blamed: outcomes.Blamed | None = None
                ) -> list[tuple[restarts.FailedRun, int]]:
    """Each blamed run with GPUs the tally saw, with its GPUs."""
    out: list[tuple[restarts.FailedRun, int]] = []
    add = out.append
    new = restarts.FailedRun.__new__
    for (key, job, end, _), hit in outcomes.gpu_blamed(tally, att, blamed):
        if hit is not None:
            # Filled directly: the frozen dataclass's __init__ set each field through
            # object.__setattr__ (a year's million blamed runs).
            f = new(restarts.FailedRun)
            f.__dict__.update(key=key, job_id=job, end=end, seconds=hit[2], user=hit[3],
                              restarts=hit[4])
            add((f, hit[1]))
    return out


def failures_by_class(runs: list[tuple[restarts.FailedRun, int]],
                      measured: restarts.Restarts,
                      restore_h: float = 0.0) -> dict[int, ettr.Columns]:
    """Per GPU class, each blamed run's length (hours, at least sacct's second) and what its
    job's restore records measured of its cost (`ettr.Failure`'s fields, as columns: a
    Failure each took a second of a year's report)."""
    rows: dict[int, list[tuple[float | None, ...]]] = defaultdict(list)
    measured_get, wait_get = measured.measured.get, measured.requeue_wait.get
    for f, gpus in runs:
        hours = max(f.seconds, 1) / 3600
        m = measured_get(f.key)
        wait = wait_get(f.key)
        if m is None and wait is not None:
            # Accounting alone: the wait for the next run is wall time on top of H; the
            # work lost stays modelled.
            each: tuple[float | None, ...] = (hours, None, wait / 3600, None, None,
                                              wait / 3600, restore_h)
        elif m is None:
            each = (hours, None, None, None, None, None, 0.0)
        elif m.lost_s is None:  # an older record: its restart whole, its lost work modelled
            each = (hours, None, m.restart_s / 3600, None, m.restart_s / 3600, None, 0.0)
        else:
            # The restore inside the next run is time in H that trained nothing: lost, like
            # the work since the save; only the wait between the runs adds wall time.
            each = (hours, m.lost_s / 3600, m.gap_s / 3600, m.lost_s / 3600,
                    m.restart_s / 3600, None, max(0.0, m.restart_s - m.gap_s) / 3600)
        rows[gpu_class(gpus)].append(each)
    return {g: ettr.Columns.of(dict(zip(ettr.FAILURE_FIELDS, map(list, zip(*rs, strict=True)),
                                        strict=True)))
            for g, rs in rows.items()}


def _no_uid(user: str) -> int | None:
    return None


def build(hist: History, opts: Options, score_cfg: ScoreConfig,
          now: datetime | None = None, gating: Gating = GATING,
          restores: tradeoffs.RestoreTimes | None = None,
          uid_of: Callable[[str], int | None] = _no_uid) -> Report:
    """``uid_of``: a user's uid, for matching restore records with the jobs accounting names
    (`report.restarts`); the default matches none."""
    return scored(begin(hist, opts, now, gating, restores, uid_of), hist, score_cfg)


@paused()  # the lemon scoring walks a million blames (`gcpause`)
def scored(draft: Report, hist: History, score_cfg: ScoreConfig) -> Report:
    """``draft`` (`begin`'s) with its lemons: the lemon scoring, most of the build's time."""
    return replace(draft, lemons=lemons.lemons(hist.attribution, score_cfg))


@paused()  # the cards walk a million blames and make a list of them (`gcpause`)
def begin(hist: History, opts: Options, now: datetime | None = None, gating: Gating = GATING,
          restores: tradeoffs.RestoreTimes | None = None,
          uid_of: Callable[[str], int | None] = _no_uid) -> Report:
    """Every section of the report but its lemons (`scored` adds them): what its charts
    show (`render.page` draws them while the lemons are scored)."""
    att = hist.attribution
    tally = hist.collected
    if not isinstance(tally, RunTally):
        raise TypeError("the history was read without a report.collect.RunTally")
    # The health-gating drains and the runs they came with, read once for the MTTF section
    # and the health card (each walked a year's drains and blames on drained nodes).
    spans = merged(hist.windows) if hist.windows else ((att.first_start, att.last_end),)
    came = list(drain_runs(att, hist.events, spans, opts.grace_s))
    rep = mttf_report(att, hist.events, opts.gpus_per_node, opts.ckpt_cost_s,
                      mttfview.PROJECT_TO, windows=hist.windows, grace_s=opts.grace_s,
                      drains=came)
    blamed = outcomes.gpu_blamed(tally, att)
    out = outcomes.outcomes(tally, att, blamed)
    runs = failed_runs(tally, att, blamed)
    measured = restarts.match(restores.records if restores else (), (f for f, _ in runs),
                              tally.watched, uid_of, tally.requeued)
    a = opts.assumptions()
    e = replace(ettr.section(rep, a, failures_by_class(runs, measured, a.restore_h),
                             {g: s / 3600 for g, s in tally.gpu_seconds.items()}),
                restores_not_owner=measured.not_owner,
                restores_unexplained=measured.unexplained,
                requeue_too_long=measured.requeue_too_long)
    # The accounting window read (a run that started a week before a one-day export does not
    # make it eight days; a cluster younger than --since is read from its registration), else
    # the runs' own span. Its days are the MTTF section's: those read, not a gap between
    # exports.
    ran = hist.window is not None or att.last_end > att.first_start
    lo, hi = hist.window or ((att.first_start, att.last_end) if ran else (0.0, 0.0))
    return Report(
        (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ"), opts.source, hist.records,
        _iso(lo) if ran else None, _iso(hi) if ran else None, round(rep.span_days, 1),
        dict(sorted(att.skipped.items())),
        mttfview.section(rep, opts.gpus_per_node, out.gang_failed_no_event),
        out, e,
        [tradeoffs.checkpoint_vs_redundancy(e),
         tradeoffs.filesystem_vs_object_store(tally, att, restores, blamed),
         tradeoffs.proactive_vs_reactive(att, hist.events, opts.grace_s, hist.windows,
                                         came),
         tradeoffs.central_vs_negotiated(tally, opts.have_topology)],
        [], drains.drains(hist.events, lo, hi), gating,
        _warnings(out), hist.window_note)


NO_GPU_TRES = ("no run in this accounting has GPUs in tres.allocated: Slurm records them only "
               "with AccountingStorageTRES=gres/gpu in slurm.conf (add it and restart "
               "slurmctld; runs from before stay without), so every GPU figure here is empty")


def _warnings(out: outcomes.Outcomes) -> list[str]:
    return [NO_GPU_TRES] if out.cpu_runs and not out.runs else []


@paused()  # a deep copy of the report: as `render`
def as_dict(r: Report) -> dict[str, Any]:
    """The report as JSON-ready data, every string writable as UTF-8 (`text.clean`). msgspec
    builds it in C (a year's report holds a quarter of a million pieces of lemon evidence:
    `asdict` and the walk cleaning each string took 8 of its 37 CPU seconds); where a string
    cannot be written as UTF-8 (a lone surrogate), every string is cleaned the slow way."""
    if msgspec is not None:
        try:
            msgspec.json.encode(r)  # raises on a lone surrogate
        except UnicodeEncodeError:
            pass
        else:
            built: dict[str, Any] = msgspec.to_builtins(r)
            return built
    out: dict[str, Any] = cleaned(asdict(r))
    return out


def as_json(r: Report, data: dict[str, Any] | None = None) -> str:
    """``data``: as `render`'s. Written by msgspec (indent 1): json.dumps took 6 s at a year."""
    return as_json_bytes(r, data).decode("utf-8")


def as_json_bytes(r: Report, data: dict[str, Any] | None = None) -> bytes:
    """`as_json` in UTF-8, without the text copy (a year's JSON is 0.3 GB)."""
    doc = as_dict(r) if data is None else data
    if msgspec is None:
        return json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8")
    return msgspec.json.format(msgspec.json.encode(doc), indent=1)
