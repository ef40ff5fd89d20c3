"""Effective training time ratio (ETTR) per job size, as Meta's study defines it: productive
training time over the wall time the job held (or waited for) its allocation. Pure.

Accounting gives each class's job-hours H and infrastructure failures F (the attribution's);
what a failure costs beyond that is modelled, each term an assumption stated on the page:
- work since the last durable checkpoint: on average half the checkpoint interval tau;
- the checkpoint stall: C per checkpoint, H / tau checkpoints;
- restart: u0 per failure (requeue wait + restore), wall time on top of H.

    ETTR = (H - F * tau/2 - H * C/tau) / (H + F * u0)

With k hot-spare nodes per job, a failure costs a swap s instead of u0, and the job holds
n + k nodes for n nodes' work: ETTR_spares = ETTR(tau = Daly, u0 = s) * n / (n + k).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.fleet.mttf import MttfReport, daly

FORMULA = "ETTR = (H - F·τ/2 - H·C/τ) / (H + F·u0)"
SPARES_FORMULA = "ETTR with k spares = ETTR(τ = Daly, u0 = s) · n / (n + k)"


@dataclass(frozen=True)
class Assumptions:
    interval_h: float  # tau today (no checkpoint manifests read: the site's stated interval)
    ckpt_cost_s: float  # C
    restart_h: float  # u0
    spares: int  # k, spare nodes per job
    swap_h: float  # s
    gpus_per_node: int


@dataclass(frozen=True)
class EttrRow:
    gpus: int
    nodes: int  # n: nodes of the class's largest run
    job_hours: float
    failures: int
    ettr_now: float | None
    daly_h: float | None
    ettr_daly: float | None
    ettr_spares: float | None


@dataclass(frozen=True)
class EttrSection:
    rows: list[EttrRow]
    fleet_now: float | None  # every class, weighted by job-hours
    fleet_daly: float | None
    fleet_spares: float | None
    assumptions: Assumptions
    formula: str = FORMULA
    spares_formula: str = SPARES_FORMULA
    modelled: str = ("modelled: lost work (τ/2 per failure), checkpoint stalls and restart "
                     "cost come from the assumptions below, not from checkpoint manifests "
                     "(none are read from accounting); H and F are measured")


def parts(h: float, f: int, tau: float, cost_h: float, u0: float) -> tuple[float, float]:
    """(productive hours, wall hours)."""
    return max(0.0, h - f * tau / 2 - h * cost_h / tau), h + f * u0


def ratio(p: tuple[float, float]) -> float | None:
    return round(p[0] / p[1], 4) if p[1] > 0 else None


def section(rep: MttfReport, a: Assumptions) -> EttrSection:
    cost_h = a.ckpt_cost_s / 3600
    rows = []
    now_sum = [0.0, 0.0]
    daly_sum = [0.0, 0.0]
    spare_sum = [0.0, 0.0]
    for c in rep.classes:
        n = max(1, c.gpus // a.gpus_per_node)
        now = parts(c.hours, c.failures, a.interval_h, cost_h, a.restart_h)
        tau = daly(cost_h, c.mttf_h) if c.mttf_h else None
        best = parts(c.hours, c.failures, tau, cost_h, a.restart_h) if tau else now
        swap = parts(c.hours, c.failures, tau or a.interval_h, cost_h, a.swap_h)
        share = n / (n + a.spares)
        spare = (swap[0] * share, swap[1])
        for acc, p in ((now_sum, now), (daly_sum, best), (spare_sum, spare)):
            acc[0] += p[0]
            acc[1] += p[1]
        rows.append(EttrRow(c.gpus, n, round(c.hours, 1), c.failures, ratio(now),
                            round(tau, 3) if tau else None, ratio(best) if tau else None,
                            ratio(spare)))
    return EttrSection(rows, ratio((now_sum[0], now_sum[1])), ratio((daly_sum[0], daly_sum[1])),
                       ratio((spare_sum[0], spare_sum[1])), a)
