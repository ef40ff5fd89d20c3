"""MTTF by job size with intervals, the 1/N projections and Meta's figures: the figures of
`fleet.mttf.report`, rounded for the page, with a Poisson interval on each. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.accounting.mttf import MttfReport
from gpuwarden.report.stats import METHOD, mttf_interval, poisson_interval

PROJECT_TO = (16_384, 131_072)


def r(x: float | None) -> float | None:
    """Rounded as the page shows it (so the JSON holds the same figures): three significant
    figures, one decimal from 100 up. Fixed decimals would show a 5-second MTTF as 0.0."""
    if x is None:
        return None
    return round(x, 1) if abs(x) >= 100 else float(f"{x:.3g}")


@dataclass(frozen=True)
class ClassRow:
    gpus: int  # runs of gpus/2 < n <= gpus GPUs
    runs: int
    job_hours: float
    failures: int
    mttf_h: float | None
    mttf_low_h: float | None
    mttf_high_h: float | None  # None: no upper bound (no failure seen)
    young_h: float | None
    daly_h: float | None
    paper_mttf_h: float | None


@dataclass(frozen=True)
class ProjectionRow:
    gpus: int
    from_node_rate_h: float | None
    from_node_rate_low_h: float | None
    from_node_rate_high_h: float | None
    from_history_h: float | None
    paper_h: float | None


@dataclass(frozen=True)
class MttfSection:
    classes: list[ClassRow]
    projections: list[ProjectionRow]
    gpu_hours: float
    failures: int
    gang_failed_no_event: int  # of `failures`: gang runs that FAILED, no node event near
    node_failures: int  # health-gating drains in the history
    node_days: float
    node_rate_per_1000_node_days: float | None
    paper_node_rate_per_1000_node_days: float
    ckpt_cost_s: float
    insufficient: str
    # The node_failures by what they did to jobs, and that said (`fleet.mttf.drains_note`).
    drains_with_failed_run: int = 0
    drains_without_gpus: int = 0
    drains_no_failed_run: int = 0
    drains_note: str = ""
    interval_method: str = METHOD
    paper: str = ("Kokolis et al., \"Revisiting Reliability in Large-Scale ML Research "
                  "Clusters\" (2024): 11 months, >150M A100 GPU-hours")


def _projection(rep: MttfReport, gpus: int, gpus_per_node: int) -> ProjectionRow:
    pr = next(p for p in rep.projections if p.gpus == gpus)
    lo_h = hi_h = None
    if pr.from_node_rate_h is not None and rep.node_days > 0:
        # r_f's interval: the count's, over the same node-days.
        lo, hi = poisson_interval(rep.node_failures)
        nodes = gpus / gpus_per_node
        lo_h = 24 / (nodes * hi / rep.node_days)
        hi_h = 24 / (nodes * lo / rep.node_days) if lo > 0 else None
    return ProjectionRow(gpus, r(pr.from_node_rate_h), r(lo_h), r(hi_h),
                         r(pr.from_history_h), pr.paper_h)


def section(rep: MttfReport, gpus_per_node: int, gang_failed_no_event: int) -> MttfSection:
    rows = []
    for c in rep.classes:
        lo, hi = mttf_interval(c.hours, c.failures)
        rows.append(ClassRow(c.gpus, c.runs, r(c.hours) or 0.0, c.failures, r(c.mttf_h),
                             r(lo), r(hi), r(c.young_h), r(c.daly_h), r(c.paper_mttf_h)))
    rate = rep.node_rate
    return MttfSection(
        rows, [_projection(rep, g, gpus_per_node) for g in PROJECT_TO],
        round(rep.gpu_hours, 1), rep.failures, gang_failed_no_event, rep.node_failures,
        round(rep.node_days, 1), r(1000 * rate) if rate is not None else None,
        round(1000 * rep.paper.node_rate, 3),
        rep.ckpt_cost_s, rep.insufficient, rep.drains_with_failed_run, rep.drains_without_gpus,
        rep.drains_no_failed_run, rep.drains_note)
