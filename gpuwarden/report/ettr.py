"""Effective training time ratio (ETTR) per job size, as Meta's study defines it: productive
training time over the wall time the job held (or waited for) its allocation. Pure.

Accounting gives each class's job-hours H, its infrastructure failures F (the attribution's)
and how long each failed run had run (t_i). What a failure costs beyond that is measured where
the job checkpointed with gpuwarden and restored after it (`report.restarts`: l_i, the work
since the restored step was saved, and u_i, failure to restored), and modelled for the rest,
each term an assumption stated on the page:
- work since the last durable checkpoint: on average half the checkpoint interval tau, and
  never more than the failed run had run: l_i = min(tau/2, t_i);
- the checkpoint stall: C per checkpoint, H / tau checkpoints;
- restart: u_i = u0 per failure (requeue wait + restore), wall time on top of H; where
  accounting shows the job requeued (and no restore record measured more), u_i is the wait
  until its next run started, and the restore inside that run, r0, is lost work.

    ETTR = (H - sum_i l_i - H * C/tau) / (H + sum_i u_i)

At the Young/Daly interval the lost work is modelled (a different tau), the restarts kept.

With k hot-spare nodes per job, a failure costs a swap s instead of u0, and the job holds
n + k nodes for n nodes' work: ETTR_spares = ETTR(tau = Daly, u0 = s) * n / (n + k), n the
size class's upper bound in nodes. A one-node size has no spare (a spare node cannot stand in
for part of it): it keeps its checkpoint-restart figure. The fleet figures weight each size by
its GPU-hours, so that a 1,024-GPU job counts for 1,024 GPUs' time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.mttf import MttfReport, daly
from gpuwarden.fleet.spares import payoff
from gpuwarden.report.mttfview import r

FORMULA = ("ETTR = (H - Σ lᵢ - H·C/τ) / (H + Σ uᵢ); lᵢ, uᵢ measured from restore records, "
           "else lᵢ = min(τ/2, tᵢ), uᵢ = u0 (or uᵢ = the requeue wait accounting measured, "
           "and r0 more in lᵢ)")
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
    # The restore inside the next run, where accounting measured only the wait for it (r0).
    restore_s: float = 300.0
    interval_h: float = 0.0  # the same in hours (set from the seconds)
    restart_h: float = 0.0
    swap_h: float = 0.0
    restore_h: float = 0.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "ckpt_cost_s", "restart_s", "swap_s", "restore_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0 or (name == "interval_s" and v <= 0):
                least = "more than" if name == "interval_s" else "at least"
                raise ValueError(f"{name} must be {least} 0, not {v}")
            object.__setattr__(self, name, _exact(v))
        for h, sec in (("interval_h", self.interval_s), ("restart_h", self.restart_s),
                       ("swap_h", self.swap_s), ("restore_h", self.restore_s)):
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
    measured: int = 0  # failures whose lost work and restart came from restore records
    requeue_measured: int = 0  # failures whose requeue wait alone came from accounting


@dataclass(frozen=True)
class Failure:
    """A failed run of one size: how long it had run (hours), and what its job's restore
    records measured of its cost (None: modelled)."""

    hours: float
    lost_h: float | None = None  # the work since the save (measured)
    restart_h: float | None = None  # wall time added
    # As the page shows them: the work since the save, and failure to restored (set with
    # restart_h).
    shown_lost_h: float | None = None
    shown_restart_h: float | None = None
    # Accounting alone measured it (no restore record): the wait until the job's next run,
    # which is then restart_h too; its lost work stays modelled.
    requeue_h: float | None = None
    # The restore inside the next run: time in H that trained nothing, lost at any interval
    # (measured from the records, r0 where accounting measured only the wait, else 0: u0
    # holds it)
    restore_h: float = 0.0


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
    measured_failures: int = 0  # with lost work and restart from restore records
    measured_lost_median_s: float | None = None
    measured_restart_median_s: float | None = None
    # Failures whose job accounting shows requeued, no restore record: their wait for the
    # next run, measured, stands for u0.
    requeue_measured: int = 0
    requeue_wait_median_s: float | None = None
    requeue_too_long: int = 0  # next runs that waited past a day (a hold): left modelled
    # Job restores after a restart left out: the job directory's owner is not the job's user
    # in accounting; no blamed run of the job came before them (a preemption, a hand requeue).
    restores_not_owner: int = 0
    restores_unexplained: int = 0
    modelled: str = ("measured: H, F and each failed run's length tᵢ (accounting); for a "
                     "failure after which the job restored a gpuwarden checkpoint, its lost "
                     "work (the failure less the restored step's save) and its restart "
                     "(failure to restored) from the job's restore records; for a failure "
                     "after which accounting shows the job requeued, its restart as the wait "
                     "until that next run started (the restore inside it is not in "
                     "accounting). Modelled for the rest: lost work τ/2 per failure (at most "
                     "what the failed run had run) and restart u0; checkpoint stalls C per τ "
                     "always")


Runs = Sequence[Failure | float]


def _failures(runs: Runs) -> list[Failure]:
    return [f if isinstance(f, Failure) else Failure(f) for f in runs]


FAILURE_FIELDS = ("hours", "lost_h", "restart_h", "shown_lost_h", "shown_restart_h",
                  "requeue_h", "restore_h")  # `Failure`'s, in its order


def _floats(values: list[float | None]) -> npt.NDArray[np.float64]:
    if values.count(None) == len(values):  # most columns of most sizes: nothing measured
        return np.full(len(values), math.nan)
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)


class Columns:
    """Failures as columns of floats (None: NaN), read once for every figure of a size: each
    of `section`'s walked a year's million failures again, and a `Failure` each took a
    second to make (`of`). The sums stay Python's, over the same terms in the same order
    (numpy's pairwise sum rounds otherwise)."""

    hours: npt.NDArray[np.float64]
    lost_h: npt.NDArray[np.float64]
    restart_h: npt.NDArray[np.float64]
    shown_lost_h: npt.NDArray[np.float64]
    shown_restart_h: npt.NDArray[np.float64]
    requeue_h: npt.NDArray[np.float64]
    restore_h: npt.NDArray[np.float64]

    def __init__(self, runs: Runs = ()) -> None:
        fs = _failures(runs)
        for name in FAILURE_FIELDS:
            setattr(self, name, _floats([getattr(f, name) for f in fs]))

    @classmethod
    def of(cls, columns: Mapping[str, list[float | None]]) -> Columns:
        """The failures whose fields (`Failure`'s, by name) are ``columns``."""
        out = cls.__new__(cls)
        for name in FAILURE_FIELDS:
            setattr(out, name, _floats(columns[name]))
        return out

    def __len__(self) -> int:
        return len(self.hours)

    def failure(self, i: int) -> Failure:
        """The ``i``-th, as a `Failure`."""
        def known(column: npt.NDArray[np.float64]) -> float | None:
            v = float(column[i])
            return None if math.isnan(v) else v
        return Failure(float(self.hours[i]), known(self.lost_h), known(self.restart_h),
                       known(self.shown_lost_h), known(self.shown_restart_h),
                       known(self.requeue_h), float(self.restore_h[i]))

    def first(self, f: int) -> Columns:
        """The first ``f`` failures."""
        if f >= len(self):
            return self
        out = Columns.__new__(Columns)
        for name in FAILURE_FIELDS:
            setattr(out, name, getattr(self, name)[:f])
        return out


def _cols(f: int, lengths: Runs | Columns) -> Columns:
    return (lengths if isinstance(lengths, Columns) else Columns(lengths[:f])).first(f)


def lost(f: int, tau: float, lengths: Runs | Columns, measured: bool = False,
         restores: bool = True) -> float:
    """Work lost to ``f`` failures: each failed run's measured loss (with ``measured``), else
    min(tau/2, t) for each of known length t, tau/2 for the rest; with ``restores``, plus the
    restore inside each next run (a hot spare's swap has none)."""
    half = tau / 2
    runs = _cols(f, lengths)
    each = np.minimum(half, runs.hours)  # min(half, t): equal values are the same float
    if measured:
        each = np.where(np.isnan(runs.lost_h), each, runs.lost_h)
    each = each + (runs.restore_h if restores else 0.0)
    terms: list[float] = each.tolist()
    return sum(terms) + max(0, f - len(runs)) * half


def restart(f: int, u0: float, lengths: Runs | Columns, measured: bool = False) -> float:
    """Wall hours ``f`` failures added: each measured restart (with ``measured``), else u0."""
    runs = _cols(f, lengths)
    each = (np.where(np.isnan(runs.restart_h), u0, runs.restart_h).tolist() if measured
            else [u0] * len(runs))
    return sum(each) + max(0, f - len(runs)) * u0


def requeue_cost(f: int, u0: float, lengths: Runs | Columns) -> float:
    """Mean hours a requeue cost the ``f`` failures, as measured where it was."""
    if not f:
        return u0
    runs = _cols(f, lengths)
    # Where accounting measured the wait only, the restore r0 after it is avoided too.
    each = np.where(~np.isnan(runs.shown_restart_h), runs.shown_restart_h,
                    np.where(np.isnan(runs.restart_h), u0, runs.restart_h + runs.restore_h))
    terms: list[float] = each.tolist()
    return (sum(terms) + max(0, f - len(runs)) * u0) / f


def parts(h: float, f: int, tau: float, cost_h: float, u0: float,
          lengths: Runs | Columns = (), lost_measured: bool = False,
          restart_measured: bool = False, restores: bool = True) -> tuple[float, float]:
    """(productive hours, wall hours)."""
    return (max(0.0, h - lost(f, tau, lengths, lost_measured, restores) - h * cost_h / tau),
            h + restart(f, u0, lengths, restart_measured))


def ratio(p: tuple[float, float]) -> float | None:
    return round(p[0] / p[1], 4) if p[1] > 0 else None


def section(rep: MttfReport, a: Assumptions, lengths: Mapping[int, Runs | Columns],
            gpu_hours: Mapping[int, float]) -> EttrSection:
    """``lengths``: per GPU class, each blamed run (a `Failure`, or the hours it had run);
    ``gpu_hours``: per GPU class, GPUs x hours (each size's weight)."""
    cost_h = a.ckpt_cost_s / 3600
    rows = []
    got: list[Failure] = []  # the failures measured from restore records, every size's
    waited: list[Failure] = []  # those measured from accounting's requeues alone
    sums = {"now": [0.0, 0.0], "daly": [0.0, 0.0], "spares": [0.0, 0.0]}
    for c in rep.classes:
        n = max(1, c.gpus // a.gpus_per_node)
        given = lengths.get(c.gpus, ())
        ts = (given if isinstance(given, Columns) else Columns(given)).first(c.failures)
        measured = [ts.failure(i) for i in np.flatnonzero(~np.isnan(ts.shown_restart_h)).tolist()]
        requeued = [ts.failure(i) for i in np.flatnonzero(~np.isnan(ts.requeue_h)).tolist()]
        got.extend(measured)
        waited.extend(requeued)
        now = parts(c.hours, c.failures, a.interval_h, cost_h, a.restart_h, ts, True, True)
        tau = daly(cost_h, c.mttf_h) if c.mttf_h else None
        best = parts(c.hours, c.failures, tau, cost_h, a.restart_h, ts, False, True) \
            if tau else now
        if n > 1:
            swap = parts(c.hours, c.failures, tau or a.interval_h, cost_h, a.swap_h, ts,
                         restores=False)
            spare = (swap[0] * n / (n + a.spares), swap[1])
        else:
            spare = best
        gh = gpu_hours.get(c.gpus) or c.hours * c.gpus
        mean_gpus = gh / c.hours if c.hours > 0 else 0.0
        for key, p in (("now", now), ("daly", best), ("spares", spare)):
            sums[key][0] += p[0] * mean_gpus
            sums[key][1] += p[1] * mean_gpus
        # What a requeue costs that a spare would not: failure to restored where the job's
        # records measured it (the restore too: a spare needs none), the measured wait where
        # only accounting did, u0 for the rest.
        u = requeue_cost(c.failures, a.restart_h, ts)
        pay = payoff(n, c.hours, c.failures, mean_gpus, a.spares, a.gpus_per_node, u,
                     a.swap_h)
        rows.append(EttrRow(c.gpus, n, r(c.hours) or 0.0, r(gh) or 0.0, c.failures, ratio(now),
                            r(tau), ratio(best) if tau else None, ratio(spare),
                            r(pay.idle_gpu_h) if pay else None,
                            r(pay.requeue_lost_gpu_h) if pay else None,
                            pay.pays if pay else None,
                            len(measured), len(requeued)))
    losses = [f.shown_lost_h * 3600 for f in got if f.shown_lost_h is not None]
    waits = [f.shown_restart_h * 3600 for f in got if f.shown_restart_h is not None]
    return EttrSection(rows, ratio((sums["now"][0], sums["now"][1])),
                       ratio((sums["daly"][0], sums["daly"][1])),
                       ratio((sums["spares"][0], sums["spares"][1])), a,
                       measured_failures=len(got),
                       measured_lost_median_s=r(statistics.median(losses)) if losses else None,
                       measured_restart_median_s=r(statistics.median(waits)) if waits
                       else None,
                       requeue_measured=len(waited),
                       requeue_wait_median_s=r(statistics.median(
                           f.requeue_h * 3600 for f in waited if f.requeue_h is not None))
                       if waited else None)
