"""The four design choices, each as figures from this site's history with what they assume
and what the history cannot tell. Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.mttf import drain_runs
from gpuwarden.accounting.windows import merged
from gpuwarden.ckpt.restorelog import MAX_PER_OWNER, MAX_RECORDS, RestoreRecord, TierRestores
from gpuwarden.report.collect import RunTally
from gpuwarden.report.ettr import EttrSection
from gpuwarden.report.mttfview import r
from gpuwarden.report.outcomes import Blamed, gpu_blamed
from gpuwarden.slurm.models import NodeEvent
from gpuwarden.slurm.reasons import drain_origin


@dataclass(frozen=True)
class Figure:
    label: str
    value: float | int | None  # None: not derivable from this history (see `missing`)
    unit: str = ""


@dataclass(frozen=True)
class Tradeoff:
    key: str
    title: str
    figures: list[Figure]
    assumptions: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def checkpoint_vs_redundancy(e: EttrSection) -> Tradeoff:
    a = e.assumptions
    return Tradeoff(
        "checkpoint_vs_redundancy", "Checkpoint-restart vs redundancy",
        [Figure("fleet ETTR at today's interval", e.fleet_now),
         Figure("fleet ETTR at the Young/Daly interval of each job size", e.fleet_daly),
         Figure(f"fleet ETTR with {a.spares} hot-spare node(s) per job", e.fleet_spares),
         Figure("failures measured from the jobs' restore records", e.measured_failures,
                "failures"),
         Figure("work lost per measured failure (median)", e.measured_lost_median_s, "s"),
         Figure("restart per measured failure, failure to restored (median)",
                e.measured_restart_median_s, "s"),
         Figure("failures whose requeue wait accounting measured (no restore record)",
                e.requeue_measured, "failures"),
         Figure("requeue wait per such failure, failure to the next run's start (median)",
                e.requeue_wait_median_s, "s")],
        [f"today's checkpoint interval τ = {a.interval_s} s (--ckpt-interval), for the "
         "failures not measured",
         f"checkpoint stall C = {a.ckpt_cost_s} s (--ckpt-cost)",
         f"restart u0 = {a.restart_s} s per failure not measured: requeue wait + restore "
         "(--restart-cost)",
         "a failure whose job accounting shows requeued (its next run, same user, restart "
         "count one more, within a day) restarts in the wait until that run started, and "
         f"loses r0 = {a.restore_s} s restoring inside it (--restore-cost), which "
         "accounting does not show",
         "a measured failure's lost work is its end less the save time of the step its job "
         "restored next, and its restart the time from its end to that restore's end (the "
         "job's own records, counted only where the job's user owns them)",
         f"a spare swaps in within s = {a.swap_s} s (--spare-swap) and absorbs every "
         "infrastructure failure of the run; spares hold nodes that do no work",
         "one-node job sizes get no spare and keep their checkpoint-restart figure",
         "job sizes with no failure keep today's interval",
         "each size weighs by its GPU-hours"],
        ["checkpoint stalls per job are not recorded (C is the site's figure)",
         "the lost work of jobs that do not checkpoint with gpuwarden, or restored from "
         "another tool's checkpoint, is modelled"]
        + ([f"{e.restores_not_owner} job restores left out: their records are in a job "
            "directory its job's user does not own"] if e.restores_not_owner else [])
        + ([f"{e.requeue_too_long} failures whose job's next run started more than a day "
            "later (a hold or a requeue by hand) are modelled, not measured"]
           if e.requeue_too_long else []))


@dataclass(frozen=True)
class RestoreTimes:
    """What the jobs recorded of their restores (`ckpt.restorelog`), for this history's span."""

    where: str  # what was read, in words: the shared root, s3://<bucket>/<prefix>, or both
    tiers: list[TierRestores]
    skipped: int  # records left out as unreadable or malformed (named in the log)
    # The records inside the span, each rank's (for lost work and restarts: `restarts.match`).
    records: list[RestoreRecord] = field(default_factory=list)
    capped: bool = False  # a cap (per owner, in all) left records out: the oldest, named in the log


def _seconds(t: TierRestores | None) -> float | None:
    # Seconds to three significant figures: a small job's restore is a fraction of one.
    return None if t is None else r(t.median_s)


def filesystem_vs_object_store(tally: RunTally, att: Attribution,
                               restores: RestoreTimes | None = None,
                               blamed: Blamed | None = None) -> Tradeoff:
    runs = gpus = 0
    for _, hit in gpu_blamed(tally, att, blamed):
        if hit is not None:
            runs += 1
            gpus += hit[1]
    by = {t.tier: t for t in (restores.tiers if restores else [])}
    fs, s3 = by.get("shared"), by.get("s3")
    worth = None
    if fs is not None and s3 is not None:
        worth = round((s3.median_s - fs.median_s) / 60 * gpus / 60, 2)
    figures = [Figure("restores after an infrastructure failure", runs, "runs"),
               Figure("GPUs held by those runs, summed", gpus, "GPUs"),
               Figure("cost of each minute of restore time", round(gpus / 60, 2),
                      "GPU-hours over this history"),
               Figure("restore time from the parallel filesystem (median)", _seconds(fs), "s"),
               Figure("restore time from the object store (median)", _seconds(s3), "s"),
               Figure("job restores from node memory or a peer (no shared read)",
                      sum(by[t].restores for t in ("memory", "peer") if t in by)
                      if restores else None, "restores"),
               Figure("object store instead of the filesystem, for these runs", worth,
                      "GPU-hours over this history")]
    assumptions = ["every failed run restores once, holding all its GPUs while it does"]
    missing = []
    if restores is None:
        missing.append("restore times per tier: the jobs record them on the shared tier "
                       "([ckpt] shared_root; pass --ckpt-root where it is mounted) or, without "
                       "one, in S3 ([ckpt] s3_bucket and key_file, or --ckpt-s3): none were read "
                       "here")
    else:
        assumptions.append(
            f"restore times as the jobs' ranks measured them (the verified read of their own "
            f"step; agreement between ranks and a requeue's prolog stage-in not counted), a "
            f"job restore taking its slowest rank's time, median per tier, from "
            f"{restores.where}: "
            + (", ".join(f"{t.tier} {t.restores} job restores, median {t.median_s:.3g} s, "
                         f"p90 {t.p90_s:.3g} s" for t in restores.tiers) or "none recorded"))
        assumptions.append("each failed run's restore takes its tier's median: the jobs "
                           "that restored need not be the ones that failed, nor the same size")
        if restores.skipped:
            missing.append(f"{restores.skipped} restore records could not be read or were "
                           "malformed: left out (named in the log)")
        if restores.capped:
            missing.append("the oldest restore records of some users were left out, past "
                           f"their share of {MAX_PER_OWNER:,} record files or "
                           f"{MAX_RECORDS:,} in all (the log names them)")
        if fs is None or s3 is None:
            missing.append("a tier with no recorded restore in this span: "
                           + ", ".join(n for n, t in (("parallel filesystem", fs),
                                                      ("object store", s3)) if t is None))
    return Tradeoff("filesystem_vs_object_store", "Parallel filesystem vs object store",
                    figures, assumptions, missing)


def proactive_vs_reactive(att: Attribution, events: Sequence[NodeEvent],
                          grace_s: float,
                          windows: Sequence[tuple[float, float]] = (),
                          drains: Sequence[tuple[NodeEvent, float, int | None]] | None = None
                          ) -> Tradeoff:
    """``windows``: the accounting read (the MTTF section's spans), else the runs' span;
    ``drains``: `drain_runs` of these, where the caller read them already (`mttf.report`'s)."""
    total = came = 0
    origins: Counter[str] = Counter()
    epilog_came = 0
    spans = merged(windows) if windows else ((att.first_start, att.last_end),)
    # The MTTF section's own split (`drain_runs`): the same drains, the same runs.
    for e, _, gpus in (drain_runs(att, events, spans, grace_s) if drains is None else drains):
        total += 1
        hit = gpus is not None
        came += hit
        origin = drain_origin(e.reason)
        origins[origin] += 1
        epilog_came += hit and origin == "epilog"
    return Tradeoff(
        "proactive_vs_reactive", "Proactive vs reactive health checking",
        [Figure("health-gating drains (the MTTF section's node failures)", total, "drains"),
         Figure("drains with no failed run behind them (found before a job failed)",
                total - came, "drains"),
         Figure("drains that came with a failed run (the failure came first)", came,
                "drains"),
         Figure("prolog drains (each kept a starting job off a bad node)", origins["prolog"],
                "drains"),
         Figure("drains by the periodic check", origins["periodic"], "drains"),
         Figure("drains by the epilog (after a job on the node)", origins["epilog"],
                "drains"),
         Figure("failures only the epilog caught (epilog drains with a failed run)",
                epilog_came, "drains"),
         Figure("drains whose reason names no check (before gpuwarden named it)",
                origins[""], "drains")],
        [f"a drain within {grace_s / 3600:g} h after a run on that node failed explains "
         "that failure (the attribution's rules 4 and 5)",
         "each prolog drain refused the job that was starting on the node (Slurm requeues "
         "it): a gang job refused on k nodes counts k times; which check set a drain is the "
         "first word of its reason"],
        ["prolog refusals on a node already drained make no new drain, and a drain the "
         "blast-radius cap undid at once still counts: jobs refused are in the nodes' "
         "verdict stores and syslog, not in accounting"])


def _mean_min(wait: int, runs: int) -> float | None:
    return round(wait / runs / 60, 1) if runs else None


def central_vs_negotiated(tally: RunTally, have_topology: bool) -> Tradeoff:
    title = "Central vs negotiated placement"
    if not have_topology:
        return Tradeoff("central_vs_negotiated", title,
                        [Figure("gang runs within one leaf switch", None, "%")], [],
                        ["which leaf switch each node hangs off: pass --topology "
                         "topology.conf", "the placement daemon's decisions are not in "
                         "accounting"])
    one = sum(n for (_, w), n in tally.gang_runs.items() if w == "one leaf")
    several = sum(n for (_, w), n in tally.gang_runs.items() if w == "several leaves")
    unknown = sum(n for (_, w), n in tally.gang_runs.items() if w == "unknown")

    def wait(where: str) -> tuple[int, int]:
        return (sum(v for (_, w), v in tally.gang_wait_s.items() if w == where),
                sum(v for (_, w), v in tally.gang_waited.items() if w == where))
    return Tradeoff(
        "central_vs_negotiated", title,
        [Figure("gang runs (more than one node)", one + several + unknown, "runs"),
         Figure("gang runs within one leaf switch", one, "runs"),
         Figure("share within one leaf switch",
                round(100 * one / (one + several), 1) if one + several else None, "%"),
         Figure("mean queue wait, within one leaf", _mean_min(*wait("one leaf")), "min"),
         Figure("mean queue wait, across leaves", _mean_min(*wait("several leaves")), "min"),
         Figure("gang runs on nodes topology.conf does not list", unknown, "runs")],
        ["queue wait = start - submit of each run; the two waits compare runs that "
         "differ in more than placement (size, partition, time)"],
        ["the placement daemon's decisions (what it held back, what it asked for) are "
         "not in accounting"])
