"""Joint attribution: per-node failure rates fitted to every failed run at once. Pure.

Model. Node i fails at rate lam[i] per hour it is in a run; a run of size bucket b also fails
at a background rate bg[b] per hour (the fabric between its nodes, the user's own gang
failures). A run fails at the sum of the rates of its nodes and its background, and ends when
it does, so each run is a Poisson process observed for its hours:

    log L = -sum_i lam[i] E[i] - sum_b bg[b] H[b] + sum_failed log(rate of what failed it)

with E[i] node i's node-hours and H[b] the job-hours of bucket b. What failed a run is the sum
over its nodes plus the background, unless the events name the node that failed (a DOWN or
NOT_RESPONDING, a health drain, sacct's `failed_node`): then only the named nodes. The fit is
expectation-maximisation: each failure is shared out in proportion to the current rates
(`share`), each rate is its shares over its exposure, accelerated by squared extrapolation
(`_Em.run`). The log-likelihood is concave, so the fit is the maximum. A healthy node that
fails only in runs with a lemon gets shares near 0: the lemon, whose rate its other runs fix,
explains them.

Test. For node i, with the other rates held at the fit, the likelihood of lam[i] alone; the
evidence against "node i fails like the fleet (rate lam0)" is the one-sided likelihood ratio,
and, for few failures, the Poisson tail of its attributed failures (lam[i] E[i]); the larger
p-value counts. What one source could have made is left out: failures the user's exit code
decided (FAILED, no node named by an event) of jobs that named the node (-w) never count
against it, and a user or job script is left out of the node's test for what it holds beyond
its share of the fleet's runs (`source_keep`), no more; the largest p-value stands. A source
holding its share loses nothing: a script every job runs (`sbatch train.sh`) is the fleet's
own background, not evidence of framing, and leaving all of it out left real lemons with
nothing. Where such a source would make a lemon, the scorer refits with only the kept part of
its failures on that node (`keep`); the rest count against none of the runs' nodes nor the
background: kept in, they made the node explain its neighbours' failures and raised the
fleet's rate; moved onto the rest of the runs, they raised the background that then explained
the node's other failures. That is the one source the node's test leaves out: leaving out a
second (two users, each half) left a flaky node seen by two users with no evidence at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from weakref import WeakKeyDictionary

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.incidence import (
    CULPRIT,
    NAMED,
    NO_SCRIPT,
    FloatArray,
    Incidence,
    IndexArray,
    IntArray,
)
from gpuwarden.lemon.distinct import Distinct, distinct_rows, every_row

BoolArray = npt.NDArray[np.bool_]

ITERATIONS = 400  # EM steps at most
TOLERANCE = 1e-6  # the log-likelihood a round of steps must still gain
# A source's excess below this (in failures) is not worth a test without it.
EXCESS_MIN = 0.25


@dataclass(frozen=True, eq=False)
class Fit:
    rate: FloatArray  # per node, failures per node-hour
    background: FloatArray  # per size bucket, failures per job-hour
    # Per entry: whether the node's rate counts in the row's hazard (a bool, not a float of 0
    # or 1: a byte an entry, not 8; as weights or a factor it is the same 0.0 or 1.0).
    use: BoolArray
    row_rate: FloatArray  # per row: the hazard that failed it, at the fit
    iterations: int
    bg_use: FloatArray | None = None  # per row: 1 where the background counts in its hazard
    weight: FloatArray | None = None  # per row: how much of its failure counts (`keep`)

    def loglik(self, inc: Incidence) -> float:
        """The log-likelihood of the fit: what a profile likelihood ratio compares."""
        counted = _any_per_row(inc, self.use)
        if self.bg_use is not None:
            counted |= self.bg_use > 0
        w = np.ones(inc.rows) if self.weight is None else self.weight
        with np.errstate(divide="ignore"):
            logs = float((w[counted] * np.log(self.row_rate[counted])).sum())
        return (logs - float((self.rate * inc.node_hours).sum())
                - float((self.background * inc.bucket_hours).sum()))

    def share(self, inc: Incidence) -> FloatArray:
        """Per entry: the part of its row's failure the node's rate explains."""
        row = inc.entry_row()
        # In place: one array of the entries at a time besides the result, not four.
        s: FloatArray = self.rate[inc.node]
        s *= self.use
        with np.errstate(divide="ignore", invalid="ignore"):
            s /= self.row_rate[row]
        return np.nan_to_num(s, copy=False)


def _any_per_row(inc: Incidence, flag: BoolArray) -> BoolArray:
    """Per row: whether any of its entries is ``flag``ged, reduced in place over each row's
    entries (a count of them by `np.bincount` made the entries' rows and flags 16 bytes an
    entry, the peak of a year's report in its profile refits)."""
    out = np.zeros(inc.rows, dtype=np.bool_)
    starts = inc.ptr[:-1]
    full = inc.ptr[1:] > starts
    if full.any():
        out[full] = np.logical_or.reduceat(flag, starts[full])
    return out


def row_weights(inc: Incidence, keep: FloatArray | None) -> FloatArray:
    """Per row: the least ``keep`` of its entries, for failures the user decided (1 for the
    rest: no source decides a failure events name)."""
    w = np.ones(inc.rows)
    if keep is None or not inc.rows:
        return w
    starts = inc.ptr[:-1]
    full = inc.ptr[1:] > starts
    if full.any():
        w[full] = np.minimum.reduceat(keep, starts[full])
    return np.where(inc.gameable, np.clip(w, 0.0, 1.0), 1.0)


def _design(inc: Incidence, keep: FloatArray | None
            ) -> tuple[IndexArray, BoolArray, FloatArray, FloatArray]:
    """Per entry its row and whether its rate counts; per row whether the background does,
    and how much of its failure counts."""
    row = inc.entry_row()
    named = (inc.flags & NAMED) > 0
    # A failure the user decided does not count against a node the job chose by name.
    active = ~(named & inc.gameable[row])
    weight = row_weights(inc, keep)
    if keep is not None:
        # Nor, for the part of one user's or script's failures on a node beyond its share
        # (`keep`), against any node of those runs: moved onto the neighbours or the
        # background of the job size, that source's failures made the background explain the
        # node's other failures.
        active &= (weight > 0)[row]
    culprit = ((inc.flags & CULPRIT) > 0) & active
    # Counted by the entries' rows, not summed as weights (8 bytes an entry at once).
    has_culprit = np.bincount(row[culprit], minlength=inc.rows) > 0
    use = active & (culprit | ~has_culprit[row])
    # A failure the user decided that counts against none of its nodes is left out of the
    # fit: in the background of its job size, one user's failures would hide every node's.
    live = (np.bincount(row[active], minlength=inc.rows) > 0) | ~inc.gameable
    bg = (~has_culprit & live).astype(np.float64)
    return row, use, bg, weight


@dataclass(frozen=True, eq=False)
class _Plain:
    """An incidence's design with no source left out (`_design` without ``keep``) and its
    runs' distinct hazards (`distinct_rows`), worked out once: a fit with sources left out
    differs only in the runs that then weigh nothing (their entries and background count for
    nothing; every other run's are the same), so each refit of the scoring reads these
    rather than redoing them (a year of a fleet: 0.9 s a fit, five fits or more)."""

    row: IndexArray  # per entry
    use: BoolArray
    bg_use: FloatArray  # per row
    live: npt.NDArray[np.bool_]  # rows something can have failed
    distinct: Distinct  # of the live rows


_PLAIN: WeakKeyDictionary[Incidence, _Plain] = WeakKeyDictionary()


def _plain(inc: Incidence) -> _Plain:
    got = _PLAIN.get(inc)
    if got is None:
        row, use, bg_use, _ = _design(inc, None)
        live = (np.bincount(row[use], minlength=inc.rows) > 0) | (bg_use > 0)
        for a in (use, bg_use, live):
            a.setflags(write=False)
        got = _PLAIN[inc] = _Plain(row, use, bg_use, live, distinct_rows(
            inc.node[use], row[use], inc.rows, inc.size, bg_use, live))
    return got


def release(inc: Incidence) -> None:
    """Forget the incidence's `_Plain`: the caller fits it no more (the scoring, once its
    rounds are done: the design's per-entry arrays were held through the lemons' evidence)."""
    _PLAIN.pop(inc, None)
    _NODE_ROWS.pop(inc, None)


def design(inc: Incidence, keep: FloatArray | None
           ) -> tuple[IndexArray, BoolArray, FloatArray, FloatArray]:
    """`_design`, from the incidence's `_Plain`: the runs ``keep`` weighs nothing in count
    for nothing (with ``keep``, `_design` drops every entry of such a run and its
    background; every other run's entries count as without ``keep``)."""
    p = _plain(inc)
    weight = row_weights(inc, keep)
    dead = weight <= 0
    if not dead.any():
        return p.row, p.use, p.bg_use, weight
    use: BoolArray = p.use & ~dead[p.row]
    bg: FloatArray = np.where(dead, 0.0, p.bg_use)
    return p.row, use, bg, weight


def fit(inc: Incidence, iterations: int = ITERATIONS, tolerance: float = TOLERANCE,
        keep: FloatArray | None = None, fixed: tuple[int, float] | None = None,
        start: Fit | None = None, *, merged: bool = True) -> Fit:
    """``keep``: per entry, how much of a gameable failure the node may be held for (1 all,
    0 none: the run then counts for no node; a row counts at the least of its entries').
    ``fixed``: (node, rate) held at that rate, every other rate re-optimised (the null of a
    profile likelihood-ratio test). ``start``: a fit to start from (fewer iterations).
    ``merged``: False iterates over every failed run, not over the distinct hazards
    (`_Em`): the reference tests/unit/test_lemon_distinct.py holds the merged fit to."""
    rows = inc.rows
    row, use, bg_use, weight = design(inc, keep) if merged else _design(inc, keep)
    exposure = inc.node_hours
    total = float(exposure.sum()) or 1.0
    bhours = inc.bucket_hours
    if start is not None:
        # A rate of 0 never moves under EM: start from a little above it.
        floor = max(rows, 1) / total * 1e-3
        rate = np.where(exposure > 0, np.maximum(start.rate, floor), 0.0)
        bfloor = max(rows, 1) / max(float(bhours.sum()), 1e-9) * 1e-3
        bg = np.where(bhours > 0, np.maximum(start.background, bfloor), 0.0)
    else:
        rate = np.where(exposure > 0, max(rows, 1) / total, 0.0)
        bg = np.where(bhours > 0, max(rows, 1) / max(float(bhours.sum()), 1e-9) / 10, 0.0)
    if fixed is not None:
        rate[fixed[0]] = fixed[1]
    em = _Em.of(inc, row, use, bg_use, weight, fixed, merged)
    rate, bg, lam_row, done = em.run(rate, bg, iterations, tolerance)
    return Fit(rate, bg, use, lam_row, done, bg_use, weight)


def _alive(c: Distinct, of_run: IntArray, alive: npt.NDArray[np.bool_]) -> Distinct:
    """``c`` with ``of_run`` for its runs and only its ``alive`` rows (in their order)."""
    if alive.all():
        return Distinct(c.reps, c.node, c.row, of_run)
    number = np.cumsum(alive) - 1
    on = alive[c.row]
    return Distinct(c.reps[alive], c.node[on], number[c.row[on]],
                    np.where(of_run >= 0, number[np.maximum(of_run, 0)], -1))


@dataclass(frozen=True, eq=False)
class _Em:
    """One fit's EM map and likelihood over the entries whose rate counts (most entries of a
    big run that events pin on one node count for nothing, and a 0 adds nothing to a sum).

    Its rows are the failed runs' distinct hazards (`distinct_rows`): runs with the same counted
    nodes, the same background use and job size fail at the same rate whatever the rates, so
    the map and the likelihood need only their summed weights. A year of a fleet repeats its
    node lists (one-node runs, gang blocks): an EM step costs what the distinct rows do."""

    node: IntArray  # per counted entry of a distinct row
    row: IntArray  # its distinct row
    size: IntArray  # per distinct row
    bg_use: FloatArray
    bg_row: npt.NDArray[np.bool_]  # rows the background counts in
    bg_size: IntArray  # their sizes
    weight: FloatArray  # per distinct row: the summed weights of its runs (all above 0)
    exposure: FloatArray
    bucket_hours: FloatArray
    fixed: tuple[int, float] | None
    runs: int  # the incidence's rows (the jump's floor is scaled by them)
    of_run: IntArray  # per incidence row: its distinct row (-1: none, its hazard is 0)

    @classmethod
    def of(cls, inc: Incidence, row: IndexArray, use: BoolArray, bg_use: FloatArray,
           weight: FloatArray, fixed: tuple[int, float] | None, merged: bool = True) -> _Em:
        """``merged``: the runs' distinct hazards, from the incidence's `_Plain` (``use``,
        ``bg_use`` must be `design`'s); else every run its own row (`_design`'s)."""
        if merged:
            p = _plain(inc)
            # A run nothing can have failed, or that counts for nothing, adds nothing to the
            # likelihood nor to a step: its hazard is 0 (`_design`), and it is left out.
            live = p.live & (weight > 0)
            c = p.distinct
            of_run = np.where(live, c.of_run, -1)
            w: FloatArray = np.bincount(of_run[live], weights=weight[live],
                                        minlength=len(c.reps)).astype(np.float64)
            c = _alive(c, of_run, w > 0)
            w = w[w > 0]
            # A row's first run may weigh nothing now: its kind's, as every run of it counts.
            bg_use = p.bg_use
        else:
            counted = use > 0
            node_c, row_c = inc.node[counted], row[counted]
            live = (np.bincount(row_c, minlength=inc.rows) > 0) | (bg_use > 0)
            live &= weight > 0
            c = every_row(node_c, row_c, inc.rows, live)
            w = weight[c.reps]
        reps = c.reps
        bg_d, size = bg_use[reps], inc.size[reps]
        on = bg_d > 0
        return cls(c.node, c.row, size, bg_d, on, size[on], w, inc.node_hours,
                   inc.bucket_hours, fixed, inc.rows, c.of_run)

    def per_run(self, lam: FloatArray) -> FloatArray:
        """A hazard per distinct row as one per incidence row."""
        out = np.zeros(self.runs)
        on = self.of_run >= 0
        out[on] = lam[self.of_run[on]]
        return out

    def hazard(self, rate: FloatArray, bg: FloatArray) -> FloatArray:
        """Per row: the rate of what could have failed it."""
        on = np.bincount(self.row, weights=rate[self.node], minlength=len(self.size))
        out: FloatArray = on + bg[self.size] * self.bg_use
        return out

    def loglik(self, rate: FloatArray, bg: FloatArray, lam_row: FloatArray) -> float:
        # Sums of products, not np.dot: BLAS's threads cost milliseconds a call on a busy host.
        with np.errstate(divide="ignore"):
            logs = float((self.weight * np.log(lam_row)).sum())
        return (logs - float((rate * self.exposure).sum())
                - float((bg * self.bucket_hours).sum()))

    def step(self, rate: FloatArray, bg: FloatArray, lam_row: FloatArray
             ) -> tuple[FloatArray, FloatArray]:
        """Each failure shared out in proportion to the rates; each rate its shares over its
        exposure (``lam_row``: the hazard at ``rate``, ``bg``)."""
        n, rows = len(rate), len(lam_row)
        inv = np.divide(self.weight, lam_row, out=np.zeros(rows), where=lam_row > 0)
        shares = np.bincount(self.node, weights=rate[self.node] * inv[self.row], minlength=n)
        new_rate = np.divide(shares, self.exposure, out=np.zeros(n), where=self.exposure > 0)
        if self.fixed is not None:
            new_rate[self.fixed[0]] = self.fixed[1]  # a conditional M-step: the rest is still EM
        bshares = np.bincount(self.bg_size, weights=(bg[self.size] * inv)[self.bg_row],
                              minlength=len(bg))
        new_bg = np.divide(bshares, self.bucket_hours, out=np.zeros(len(bg)),
                           where=self.bucket_hours > 0)
        return new_rate, new_bg

    def run(self, rate: FloatArray, bg: FloatArray, iterations: int, tolerance: float
            ) -> tuple[FloatArray, FloatArray, FloatArray, int]:
        """EM accelerated by squared extrapolation (SQUAREM, Varadhan and Roland 2008): two
        steps, a jump along them as far as their shrinking suggests, one step from there,
        kept only where it raised the likelihood (two plain steps otherwise), so every round
        still climbs. Plain EM crawls along a gang block's ridge: 400 steps left a 12,500-node
        fit 0.004 short of its maximum and a node's attributed failures 0.3 off; this gets
        within 1e-6 in about a hundred steps. Until a round gains less than ``tolerance`` or
        ``iterations`` steps are spent."""
        rows = self.runs
        # A jump may overshoot a rate that is shrinking to 0: it lands a little above 0 (a
        # rate of exactly 0 never moves under EM).
        tiny = max(rows, 1) / (float(self.exposure.sum()) or 1.0) * 1e-12
        btiny = max(rows, 1) / max(float(self.bucket_hours.sum()), 1e-9) * 1e-12
        lam_row = self.hazard(rate, bg)
        ll = self.loglik(rate, bg, lam_row)
        done = 0
        while done < iterations:
            r1, b1 = self.step(rate, bg, lam_row)
            lam1 = self.hazard(r1, b1)
            r2, b2 = self.step(r1, b1, lam1)
            done += 2
            dr, db, vr, vb = r1 - rate, b1 - bg, r2 - 2 * r1 + rate, b2 - 2 * b1 + bg
            v = math.sqrt(float((vr * vr).sum() + (vb * vb).sum()))
            d = math.sqrt(float((dr * dr).sum() + (db * db).sum()))
            alpha = -max(1.0, d / v) if v > 0 else -1.0
            jr = np.where(r2 > 0, np.maximum(rate - 2 * alpha * dr + alpha**2 * vr, tiny), 0.0)
            jb = np.where(b2 > 0, np.maximum(bg - 2 * alpha * db + alpha**2 * vb, btiny), 0.0)
            if self.fixed is not None:
                jr[self.fixed[0]] = self.fixed[1]
            lam_j = self.hazard(jr, jb)
            if self.loglik(jr, jb, lam_j) >= ll:
                rate, bg = self.step(jr, jb, lam_j)
                done += 1
            else:
                rate, bg = r2, b2
            lam_row = self.hazard(rate, bg)
            before, ll = ll, self.loglik(rate, bg, lam_row)
            if ll - before < tolerance:
                break
        return rate, bg, self.per_run(lam_row), done


@dataclass(frozen=True)
class NodeTest:
    p_value: float
    rate: float  # the node's own rate on the evidence that stood
    attributed: float  # failures that evidence puts on the node (rate x exposure)
    left_out: str  # which source was left out to get this p-value ("" for none)
    source: tuple[str, int] | None = None  # that source: ("user" or "script", its index)
    full_p: float = 1.0  # the p-value on all of the node's evidence
    kept: float = 1.0  # the part of that source's failures on the node that stood


@dataclass(frozen=True, eq=False)
class Evidence:
    """The failed runs a node was in, as its test sees them; their users, scripts and
    whether the user decided them read from the incidence when first asked (most nodes'
    tests end at their rate, below the fleet's, without them)."""

    rest: FloatArray  # per failure: the hazard of everything else that could have failed it
    rows: IndexArray  # per failure: its run, a row of ``inc``
    inc: Incidence = field(repr=False)
    exposure: float
    weight: FloatArray | None = None  # per failure: how much of it counts (1: all)

    @cached_property
    def user(self) -> IntArray:
        out: IntArray = self.inc.user[self.rows]
        return out

    @cached_property
    def script(self) -> IntArray:
        out: IntArray = self.inc.script[self.rows]
        return out

    @cached_property
    def gameable(self) -> npt.NDArray[np.bool_]:
        out: npt.NDArray[np.bool_] = self.inc.gameable[self.rows]
        return out

    def weights(self) -> FloatArray:
        return np.ones(len(self.rest)) if self.weight is None else self.weight


def node_rate(rest: FloatArray, exposure: float, weight: FloatArray | None = None) -> float:
    """The rate maximising -r E + sum w log(r + rest): where sum w / (r + rest) = E."""
    w = np.ones(len(rest)) if weight is None else weight
    if exposure <= 0 or len(rest) == 0 or float(w.sum()) <= 0:
        return 0.0
    # The failures that count, picked once (every weight counts where none were given).
    if weight is not None:
        on = w > 0
        w, rest = w[on], rest[on]
    if (rest > 0).all() and float((w / rest).sum()) <= exposure:
        return 0.0
    # Newton on g(r) = sum w / (r + rest) - E, decreasing and convex: a step from either
    # side of the root lands at or below it, and from below the steps climb to it, so a
    # handful replace bisection's 80 sums (the per-node test runs for every node, every
    # round). A step that leaves the bracket bisects instead.
    lo, hi = 0.0, float(w.sum()) / exposure
    r = hi
    # Each step's arrays written in place (the same sums of the same numbers as
    # ``(w / (r + rest)).sum()``: a step was eight short-lived arrays, 12,500 nodes a round).
    d, inv, ratio = np.empty_like(rest), np.empty_like(rest), np.empty_like(rest)
    add, divide, total = np.add, np.divide, np.add.reduce
    for _ in range(100):
        add(rest, r, out=d)
        divide(w, d, out=inv)
        g = float(total(inv)) - exposure
        if g > 0:
            lo = r
        else:
            hi = r
        divide(inv, d, out=ratio)
        slope = float(total(ratio))
        nxt = r + g / slope if slope > 0 and math.isfinite(slope) else math.nan
        if not lo < nxt < hi:
            nxt = (lo + hi) / 2
        if abs(nxt - r) <= 1e-15 * r or hi - lo <= 1e-15 * hi:
            return nxt
        r = nxt
    return r


def _loglik(r: float, rest: FloatArray, exposure: float, w: FloatArray) -> float:
    on = w > 0
    with np.errstate(divide="ignore"):
        return float(-r * exposure + np.dot(w[on], np.log(r + rest[on])))


def gamma_p(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x): P(Poisson(x) >= a) for a whole number a."""
    if a <= 0:
        return 1.0
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # series
        term = total = 1.0 / a
        k = a
        while term > total * 1e-15:  # both positive here: abs() was a fifth of the scan
            k += 1
            term *= x / k
            total += term
        return min(1.0, math.exp(log_front) * total)
    # continued fraction for the upper part (Lentz)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_front) * h)


def test_rate(rest: FloatArray, exposure: float, null: float,
              weight: FloatArray | None = None) -> tuple[float, float]:
    """(p-value, rate) for "the node's rate is above `null`"; ``weight``: how much of each
    failure counts (a source's failures beyond its share count for none)."""
    w = np.ones(len(rest)) if weight is None else weight
    r = node_rate(rest, exposure, w)
    if r <= null or exposure <= 0:
        return 1.0, r
    d = max(0.0, 2 * (_loglik(r, rest, exposure, w) - _loglik(null, rest, exposure, w)))
    p_lrt = 0.5 * math.erfc(math.sqrt(d / 2))
    # The likelihood ratio is too bold on a handful of failures: the Poisson tail of the
    # failures the fit attributes to the node is exact when events name it in each.
    p_pois = gamma_p(r * exposure, null * exposure)
    return max(p_lrt, p_pois), r


def evidence(inc: Incidence, f: Fit, node: int, entries: IntArray) -> Evidence:
    """`entries`: the node's entries in the incidence."""
    row = inc.entry_row()[entries]
    mask = f.use[entries] > 0
    return _evidence(inc, f, node, row[mask])


def _evidence(inc: Incidence, f: Fit, node: int, rows: IntArray) -> Evidence:
    rest = np.maximum(f.row_rate[rows] - f.rate[node], 0.0)
    return Evidence(rest, rows, inc, float(inc.node_hours[node]),
                    None if f.weight is None else f.weight[rows])


@dataclass(frozen=True, eq=False)
class _NodeRows:
    """The rows of the entries whose rate counts in the incidence's plain design (`_plain`),
    node by node in `Incidence.by_node`'s order: a node's one slice. Gathered from the whole
    incidence for each node in turn (`evidence`), they were half of the per-node tests,
    12,500 nodes a round."""

    bounds: IntArray  # per node: where its slice of ``rows`` starts
    rows: IndexArray
    use: BoolArray  # the plain design's, that these were read with


_NODE_ROWS: WeakKeyDictionary[Incidence, _NodeRows] = WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class _FitRows:
    """Of one fit, per row: its hazard and its weight side by side (one row of two: a
    single read of memory for both at a run, and a node's runs lie all over a year's
    million); ``same``: whether the fit's ``use`` is the plain design's, less the runs it
    weighs nothing in (as `design` makes it), so that `_NodeRows` less those runs are its
    nodes' evidence; ``dead``: whether it weighs any run nothing."""

    same: bool
    dead: bool
    rate_weight: npt.NDArray[np.float64]  # (rows, 2): hazard, weight


_FIT_ROWS: WeakKeyDictionary[Fit, _FitRows] = WeakKeyDictionary()


def _node_rows(inc: Incidence) -> _NodeRows:
    p = _plain(inc)
    got = _NODE_ROWS.get(inc)
    if got is None or got.use is not p.use:
        order, bounds = inc.by_node()
        on = p.use[order]
        rows = inc.entry_row()[order][on]
        # Each node's count, not a running count of every entry (a cast to 8 bytes an
        # entry, a third of a second at a year).
        counts = np.fromiter((np.count_nonzero(on[a:b]) for a, b in
                              zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)),
                             dtype=np.int64, count=len(bounds) - 1)
        starts = np.zeros(len(bounds), dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        got = _NODE_ROWS[inc] = _NodeRows(starts, rows, p.use)
    return got


def _fit_rows(inc: Incidence, f: Fit, t: _NodeRows) -> _FitRows:
    got = _FIT_ROWS.get(f)
    if got is None:
        both = np.empty((inc.rows, 2), dtype=np.float64)
        both[:, 0] = f.row_rate
        both[:, 1] = 1.0 if f.weight is None else f.weight
        dead = both[:, 1] <= 0  # NaN is not: `design` keeps such runs
        same = f.use is t.use and not dead.any()
        if not same:
            # Per entry as `design` leaves them out (a run's entries lie together).
            same = bool(np.array_equal(t.use & ~np.repeat(dead, np.diff(inc.ptr)), f.use))
        got = _FIT_ROWS[f] = _FitRows(same, bool(dead.any()), both)
    return got


def ready(inc: Incidence, f: Fit) -> None:
    """What `node_evidence` reads for ``f``, made now (before a fork: the child reads it
    too)."""
    _fit_rows(inc, f, _node_rows(inc))


def node_evidence(inc: Incidence, f: Fit, node: int, entries: IntArray) -> Evidence:
    """`evidence`, where ``entries`` are all of the node's (`Incidence.by_node`): read from
    `_NodeRows` and `_FitRows`, the same arrays (else as `evidence` reads them)."""
    t = _node_rows(inc)
    fr = _fit_rows(inc, f, t)
    if not fr.same:
        return evidence(inc, f, node, entries)
    rows = t.rows[int(t.bounds[node]):int(t.bounds[node + 1])]
    got = fr.rate_weight[rows]
    weight = got[:, 1]
    if fr.dead:
        on = ~(weight <= 0)  # the runs the fit weighs nothing in count for no node
        rows, got = rows[on], got[on]
        weight = got[:, 1]
    rest = np.maximum(got[:, 0] - f.rate[node], 0.0)
    return Evidence(rest, rows, inc, float(inc.node_hours[node]),
                    None if f.weight is None else np.ascontiguousarray(weight))


# A source keeps up to the upper (1 - CHANCE) quantile of what its share predicts: taken as
# the point, chance alone (3 of a lemon's 6 failures on one user's jobs) counted as excess
# and cost lemons near the limit their verdict.
CHANCE = 0.05


def poisson_upper(mean: float) -> float:
    """The smallest k with P(Poisson(mean) > k) <= CHANCE (infinite for an infinite mean)."""
    if not math.isfinite(mean):
        return math.inf
    k = least = math.floor(mean)
    # The search from the mean took a step for each of the 1.6 standard deviations to the
    # quantile: it starts a little below where the normal approximation puts it, where the
    # count is still too small (else from the mean), so each k below it fails as well
    # (P(Poisson(mean) > k) falls with k).
    guess = math.floor(mean + 1.6448536 * math.sqrt(max(mean, 0.0)) - 2)
    if guess > least and gamma_p(guess, mean) > CHANCE:
        k = guess
    while gamma_p(k + 1, mean) > CHANCE:
        k += 1
    return float(k)


@dataclass(frozen=True)
class SourceKeep:
    """One source's failures on one node, against its share of the fleet's runs."""

    label: str  # "user" or "script"
    index: int  # in `Incidence.users` / `scripts`
    failures: float  # its failures the user decided there, as the node's shares of them
    excess: float  # of those, what it holds beyond its share
    share: float  # its share of the fleet's node-hours

    @property
    def kept(self) -> float:
        """The part of its failures that stands."""
        return 1.0 - self.excess / self.failures if self.failures > 0 else 1.0

    def words(self, names: tuple[str, ...]) -> str:
        return (f"{self.excess:.1f} of {self.failures:.1f} failure(s) of {self.label} "
                f"{names[self.index]!s} left out (beyond its {self.share:.1%} of the fleet's "
                "node-hours)")


def source_keep(inc: Incidence, ev: Evidence, rate: float, label: str) -> list[SourceKeep]:
    """Per user (``label`` "user") or job script ("script") among the node's failures the user
    decided: what it holds on the node beyond its share of the fleet's runs, largest first.

    Under "the node fails every source's runs alike, and each source runs on it as it runs on
    the fleet", a source with a share p of the fleet's node-hours holds p of the node's
    failures (of every kind), give or take chance (`poisson_upper`). A user could have made
    her own failures, so hers are measured
    against what the others show: p / (1 - p) times their failures; one user alone can then
    at most match the rest (p <= 1/2), however many jobs she fails, and one who runs across the
    fleet loses only a lucky concentration. A script does not choose nodes (its users do, and
    are tested as users), so its failures are measured against all of the node's: a script
    every job runs is the fleet's own background and loses nothing, while one that fails for
    its own reasons on a few nodes (a broken partition's) holds little of the fleet's runs and
    loses nearly all. A source's failures events name are never left out."""
    key, share_of = (ev.user, inc.user_share()) if label == "user" else (ev.script,
                                                                         inc.script_share())
    if not ev.gameable.any() or rate <= 0:
        return []
    s = ev.weights() * rate / (rate + ev.rest)  # the node's part of each failure
    total = float(s.sum())
    size = max(int(key.max(initial=-1)) + 1, 0)
    ok = key != NO_SCRIPT
    every = np.bincount(key[ok], weights=s[ok], minlength=size)
    g = ok & ev.gameable
    mine = np.bincount(key[g], weights=s[g], minlength=size)
    out = []
    for k in np.flatnonzero(mine > 0):
        p = float(share_of[k]) if k < len(share_of) else 0.0
        if label == "user":
            expected = math.inf if p >= 1 else (total - float(every[k])) * p / (1 - p)
        else:
            expected = p * total
        named = float(every[k] - mine[k])
        m = float(mine[k])
        if math.isfinite(expected) and math.floor(expected) - named >= m:
            # `poisson_upper` is at least the mean's floor, which keeps all of it already:
            # its search (gamma_p at each count) was most of the per-node tests.
            kept = m
        else:
            kept = min(m, max(0.0, poisson_upper(expected) - named))
        out.append(SourceKeep(label, int(k), m, m - kept, p))
    out.sort(key=lambda x: (-x.excess, x.index))
    return out


def robust_test(inc: Incidence, ev: Evidence, null: float, spent: bool = False) -> NodeTest:
    """The node's test on all its evidence, then without what its user and its job script
    holding the most beyond their shares of the fleet's runs hold beyond them
    (`source_keep`); the weakest result stands. ``spent``: the fit already left one source
    out of this node's evidence; one is all a node's test leaves out (with two users each
    holding half, leaving out the second after the first left nothing, and a flaky node was
    missed)."""
    w = ev.weights()
    p, r = test_rate(ev.rest, ev.exposure, null, w)
    worst = NodeTest(p, r, r * ev.exposure, "", full_p=p)
    if spent or p >= 1.0 or not ev.gameable.any():
        return worst
    for label in ("user", "script"):
        found = source_keep(inc, ev, r, label)
        if not found or found[0].excess < EXCESS_MIN:
            continue  # every source holds its share: leaving one out would only discard
        top = found[0]
        key = ev.user if label == "user" else ev.script
        w2 = np.where(ev.gameable & (key == top.index), w * top.kept, w)
        p2, r2 = test_rate(ev.rest, ev.exposure, null, w2)
        if p2 > worst.p_value:
            names = inc.users if label == "user" else inc.scripts
            worst = NodeTest(p2, r2, r2 * ev.exposure, top.words(names), (label, top.index),
                             p, top.kept)
    return worst


def source_entries(inc: Incidence, entries: IntArray, source: tuple[str, int]) -> IntArray:
    """Of a node's `entries`, those of failures the user decided that came from `source`."""
    row = inc.entry_row()[entries]
    key = inc.user if source[0] == "user" else inc.script
    out: IntArray = entries[inc.gameable[row] & (key[row] == source[1])]
    return out
