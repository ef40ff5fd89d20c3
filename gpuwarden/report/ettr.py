"""Effective training time ratio (ETTR) per job size, as Meta's study defines it: productive
training time over the wall time the job held (or waited for) its allocation. Pure.

Accounting gives each class's job-hours H, its infrastructure failures F (the attribution's)
and how long each failed run had run (t_i); what a failure costs beyond that is modelled, each
term an assumption stated on the page:
- work since the last durable checkpoint: on average half the checkpoint interval tau, and
  never more than the failed run had run: min(tau/2, t_i);
- the checkpoint stall: C per checkpoint, H / tau checkpoints;
- restart: u0 per failure (requeue wait + restore), wall time on top of H.

    ETTR = (H - sum_i min(tau/2, t_i) - H * C/tau) / (H + F * u0)

With k hot-spare nodes per job, a failure costs a swap s instead of u0, and the job holds
n + k nodes for n nodes' work: ETTR_spares = ETTR(tau = Daly, u0 = s) * n / (n + k), n the
size class's upper bound in nodes. A one-node size has no spare (a spare node cannot stand in
for part of it): it keeps its checkpoint-restart figure. The fleet figures weight each size by
its GPU-hours, so that a 1,024-GPU job counts for 1,024 GPUs' time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuwarden.fleet.mttf import MttfReport, daly
from gpuwarden.fleet.spares import payoff
from gpuwarden.report.mttfview import r

FORMULA = "ETTR = (H - Σ min(τ/2, tᵢ) - H·C/τ) / (H + F·u0)"
SPARES_FORMULA = "ETTR with k spares = ETTR(τ = Daly, u0 = s) · n / (n + k), for n > 1"


def _exact(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


@dataclass(frozen=True)
class Assumptions:
    """Exact, as given (not rounded: a 1 s interval stays 1 s)."""

    interval_s: float  # tau today (no checkpoint manifests read: the site's stated interval)
    ckpt_cost_s: float  # C
    restart_s: float  # u0
    spares: int  # k, spare nodes per job
    swap_s: float  # s
    gpus_per_node: int
    interval_h: float = 0.0  # the same in hours (set from the seconds)
    restart_h: float = 0.0
    swap_h: float = 0.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "ckpt_cost_s", "restart_s", "swap_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0 or (name == "interval_s" and v <= 0):
                least = "more than" if name == "interval_s" else "at least"
                raise ValueError(f"{name} must be {least} 0, not {v}")
            object.__setattr__(self, name, _exact(v))
        for h, sec in (("interval_h", self.interval_s), ("restart_h", self.restart_s),
                       ("swap_h", self.swap_s)):
            object.__setattr__(self, h, sec / 3600)


@dataclass(frozen=True)
class EttrRow:
    gpus: int
    nodes: int  # n: the size class's upper bound in nodes (GPUs / GPUs per node, at least 1)
    job_hours: float
    gpu_hours: float  # the row's weight in the fleet figures
    failures: int
    ettr_now: float | None
    daly_h: float | None  # None: no failure, so no Daly interval
    ettr_daly: float | None  # None with daly_h
    ettr_spares: float | None  # one-node sizes: their checkpoint-restart figure (no spare)
    # Redundancy's price and gain for multi-node sizes (None for one node): the GPU-hours k
    # spare nodes per job hold idle, H x k x GPUs per node; the GPU-hours requeues lose that a
    # spare would not, F x (u0 - s) x the size's mean GPUs; and whether the gain is larger.
    spare_idle_gpu_h: float | None = None
    requeue_lost_gpu_h: float | None = None
    spares_pay: bool | None = None


@dataclass(frozen=True)
class EttrSection:
    rows: list[EttrRow]
    fleet_now: float | None  # every class, weighted by GPU-hours
    fleet_daly: float | None  # sizes with no failure at today's interval
    fleet_spares: float | None
    assumptions: Assumptions
    formula: str = FORMULA
    spares_formula: str = SPARES_FORMULA
    weighting: str = ("all sizes, weighted by GPU-hours; at Young/Daly, sizes with no failure "
                      "count at today's τ")
    modelled: str = ("modelled: lost work (τ/2 per failure, at most what the failed run had "
                     "run), checkpoint stalls and restart cost come from the assumptions "
                     "below, not from checkpoint manifests (none are read from accounting); H, "
                     "F and each failed run's length tᵢ are measured")


def lost(f: int, tau: float, lengths: Sequence[float]) -> float:
    """Work lost to ``f`` failures: min(tau/2, t) for each failed run of known length t, tau/2
    for the rest."""
    half = tau / 2
    return sum(min(half, t) for t in lengths[:f]) + max(0, f - len(lengths)) * half


def parts(h: float, f: int, tau: float, cost_h: float, u0: float,
          lengths: Sequence[float] = ()) -> tuple[float, float]:
    """(productive hours, wall hours)."""
    return max(0.0, h - lost(f, tau, lengths) - h * cost_h / tau), h + f * u0


def ratio(p: tuple[float, float]) -> float | None:
    return round(p[0] / p[1], 4) if p[1] > 0 else None


def section(rep: MttfReport, a: Assumptions, lengths: Mapping[int, Sequence[float]],
            gpu_hours: Mapping[int, float]) -> EttrSection:
    """``lengths``: per GPU class, the hours each blamed run had run; ``gpu_hours``: per GPU
    class, GPUs x hours (each size's weight)."""
    cost_h = a.ckpt_cost_s / 3600
    rows = []
    sums = {"now": [0.0, 0.0], "daly": [0.0, 0.0], "spares": [0.0, 0.0]}
    for c in rep.classes:
        n = max(1, c.gpus // a.gpus_per_node)
        ts = lengths.get(c.gpus, ())
        now = parts(c.hours, c.failures, a.interval_h, cost_h, a.restart_h, ts)
        tau = daly(cost_h, c.mttf_h) if c.mttf_h else None
        best = parts(c.hours, c.failures, tau, cost_h, a.restart_h, ts) if tau else now
        if n > 1:
            swap = parts(c.hours, c.failures, tau or a.interval_h, cost_h, a.swap_h, ts)
            spare = (swap[0] * n / (n + a.spares), swap[1])
        else:
            spare = best
        gh = gpu_hours.get(c.gpus) or c.hours * c.gpus
        mean_gpus = gh / c.hours if c.hours > 0 else 0.0
        for key, p in (("now", now), ("daly", best), ("spares", spare)):
            sums[key][0] += p[0] * mean_gpus
            sums[key][1] += p[1] * mean_gpus
        pay = payoff(n, c.hours, c.failures, mean_gpus, a.spares, a.gpus_per_node,
                     a.restart_h, a.swap_h)
        rows.append(EttrRow(c.gpus, n, r(c.hours) or 0.0, r(gh) or 0.0, c.failures, ratio(now),
                            r(tau), ratio(best) if tau else None, ratio(spare),
                            r(pay.idle_gpu_h) if pay else None,
                            r(pay.requeue_lost_gpu_h) if pay else None,
                            pay.pays if pay else None))
    return EttrSection(rows, ratio((sums["now"][0], sums["now"][1])),
                       ratio((sums["daly"][0], sums["daly"][1])),
                       ratio((sums["spares"][0], sums["spares"][1])), a)
