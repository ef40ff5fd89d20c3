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
(`share`), each rate is its shares over its exposure. The log-likelihood is concave, so the
fit is the maximum. A healthy node that fails only in runs with a lemon gets shares near 0:
the lemon, whose rate its other runs fix, explains them.

Test. For node i, with the other rates held at the fit, the likelihood of lam[i] alone; the
evidence against "node i fails like the fleet (rate lam0)" is the one-sided likelihood ratio,
and, for few failures, the Poisson tail of its attributed failures (lam[i] E[i]); the larger
p-value counts. What one source could have made is left out: failures the user's exit code
decided (FAILED, no node named by an event) of jobs that named the node (-w) never count
against it, and when the node's most incriminating user or job script carries at least
`DOMINANT` of its excess over the fleet, the test is repeated without that source's
failures; the largest p-value stands. Leaving a source out when none dominates (six users
each holding a sixth) discards real evidence: a lemon then loses a fifth of its failures.
Where such a source would make a lemon, the scorer refits without its failures on that node
(`drop`), which then count against none of the runs' nodes nor the background: kept in, it made
the node explain its neighbours' failures and raised the fleet's rate; moved onto the rest of
the runs, it raised the background that then explained the node's other failures. That is the
one source the node's test leaves out: leaving out a second (two users, each half) left a
flaky node seen by two users with no evidence at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.incidence import CULPRIT, NAMED, NO_SCRIPT, FloatArray, Incidence, IntArray

ITERATIONS = 400
TOLERANCE = 1e-7
# A user or job script is left out of a node's test when its failures carry at least this share
# of the node's excess over the fleet: one source alone can then at most double the evidence.
DOMINANT = 0.5


@dataclass(frozen=True, eq=False)
class Fit:
    rate: FloatArray  # per node, failures per node-hour
    background: FloatArray  # per size bucket, failures per job-hour
    use: FloatArray  # per entry: 1 where the node's rate counts in the row's hazard
    row_rate: FloatArray  # per row: the hazard that failed it, at the fit
    iterations: int
    bg_use: FloatArray | None = None  # per row: 1 where the background counts in its hazard

    def loglik(self, inc: Incidence) -> float:
        """The log-likelihood of the fit: what a profile likelihood ratio compares."""
        counted = np.bincount(inc.entry_row(), weights=self.use, minlength=inc.rows) > 0
        if self.bg_use is not None:
            counted |= self.bg_use > 0
        with np.errstate(divide="ignore"):
            logs = float(np.sum(np.log(self.row_rate[counted])))
        return (logs - float(np.dot(self.rate, inc.node_hours))
                - float(np.dot(self.background, inc.bucket_hours)))

    def share(self, inc: Incidence) -> FloatArray:
        """Per entry: the part of its row's failure the node's rate explains."""
        row = inc.entry_row()
        with np.errstate(divide="ignore", invalid="ignore"):
            s = self.rate[inc.node] * self.use / self.row_rate[row]
        return np.nan_to_num(s)


def _design(inc: Incidence, drop: npt.NDArray[np.bool_] | None
            ) -> tuple[IntArray, FloatArray, FloatArray]:
    """Per entry its row and whether its rate counts; per row whether the background does."""
    row = inc.entry_row()
    named = (inc.flags & NAMED) > 0
    # A failure the user decided does not count against a node the job chose by name.
    active = ~(named & inc.gameable[row])
    if drop is not None:
        # Nor, where one user or script dominates a node's evidence (`drop`), against any
        # node of those runs: moved onto the neighbours or the background of the job size,
        # that source's failures made the background explain the node's other failures.
        out = np.bincount(row, weights=drop & inc.gameable[row], minlength=inc.rows) > 0
        active &= ~out[row]
    culprit = ((inc.flags & CULPRIT) > 0) & active
    has_culprit = np.bincount(row, weights=culprit, minlength=inc.rows) > 0
    use = (active & (culprit | ~has_culprit[row])).astype(np.float64)
    # A failure the user decided that counts against none of its nodes is left out of the
    # fit: in the background of its job size, one user's failures would hide every node's.
    live = (np.bincount(row, weights=active, minlength=inc.rows) > 0) | ~inc.gameable
    bg = (~has_culprit & live).astype(np.float64)
    return row, use, bg


def fit(inc: Incidence, iterations: int = ITERATIONS, tolerance: float = TOLERANCE,
        drop: npt.NDArray[np.bool_] | None = None, fixed: tuple[int, float] | None = None,
        start: Fit | None = None) -> Fit:
    """``drop``: per entry, the gameable failures the node is not to be held for.
    ``fixed``: (node, rate) held at that rate, every other rate re-optimised (the null of a
    profile likelihood-ratio test). ``start``: a fit to start from (fewer iterations)."""
    n, rows = len(inc.names), inc.rows
    row, use, bg_use = _design(inc, drop)
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
    size = inc.size
    # Only the entries whose rate counts: most entries of a big run that events pin on one
    # node count for nothing (use 0), and a 0 adds nothing to a sum, so the fit is the same.
    counted = use > 0
    node_c, row_c = inc.node[counted], row[counted]
    bg_row = bg_use > 0
    lam_row = np.ones(rows)
    done = 0
    for done in range(1, iterations + 1):  # noqa: B007 - the count is reported
        on_node = rate[node_c]
        lam_row = np.bincount(row_c, weights=on_node, minlength=rows) + bg[size] * bg_use
        inv = np.divide(1.0, lam_row, out=np.zeros(rows), where=lam_row > 0)
        shares = np.bincount(node_c, weights=on_node * inv[row_c], minlength=n)
        new_rate = np.divide(shares, exposure, out=np.zeros(n), where=exposure > 0)
        if fixed is not None:
            new_rate[fixed[0]] = fixed[1]  # a conditional M-step: the rest is still EM
        bshares = np.bincount(size[bg_row], weights=(bg[size] * inv)[bg_row], minlength=len(bg))
        new_bg = np.divide(bshares, bhours, out=np.zeros(len(bg)), where=bhours > 0)
        change = float(np.max(np.abs(new_rate - rate) * exposure, initial=0.0))
        rate, bg = new_rate, new_bg
        if change < tolerance:
            break
    lam_row = np.bincount(row_c, weights=rate[node_c], minlength=rows) + bg[size] * bg_use
    return Fit(rate, bg, use, lam_row, done, bg_use)


@dataclass(frozen=True)
class NodeTest:
    p_value: float
    rate: float  # the node's own rate on the evidence that stood
    attributed: float  # failures that evidence puts on the node (rate x exposure)
    left_out: str  # which source was left out to get this p-value ("" for none)
    source: tuple[str, int] | None = None  # that source: ("user" or "script", its index)
    full_p: float = 1.0  # the p-value on all of the node's evidence


@dataclass(frozen=True)
class Evidence:
    """The failed runs a node was in, as its test sees them."""

    rest: FloatArray  # per failure: the hazard of everything else that could have failed it
    user: IntArray
    script: IntArray
    gameable: npt.NDArray[np.bool_]
    exposure: float


def node_rate(rest: FloatArray, exposure: float) -> float:
    """The rate maximising -r E + sum log(r + rest): where sum 1/(r + rest) = E."""
    if exposure <= 0 or len(rest) == 0:
        return 0.0
    if np.all(rest > 0) and float(np.sum(1.0 / rest)) <= exposure:
        return 0.0
    lo, hi = 0.0, len(rest) / exposure
    for _ in range(80):
        mid = (lo + hi) / 2
        if float(np.sum(1.0 / (mid + rest))) > exposure:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _loglik(r: float, rest: FloatArray, exposure: float) -> float:
    with np.errstate(divide="ignore"):
        return float(-r * exposure + np.sum(np.log(r + rest)))


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
        while abs(term) > abs(total) * 1e-15:
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


def test_rate(rest: FloatArray, exposure: float, null: float) -> tuple[float, float]:
    """(p-value, rate) for "the node's rate is above `null`"."""
    r = node_rate(rest, exposure)
    if r <= null or exposure <= 0:
        return 1.0, r
    d = max(0.0, 2 * (_loglik(r, rest, exposure) - _loglik(null, rest, exposure)))
    p_lrt = 0.5 * math.erfc(math.sqrt(d / 2))
    # The likelihood ratio is too bold on a handful of failures: the Poisson tail of the
    # failures the fit attributes to the node is exact when events name it in each.
    p_pois = gamma_p(r * exposure, null * exposure)
    return max(p_lrt, p_pois), r


def evidence(inc: Incidence, f: Fit, node: int, entries: IntArray) -> Evidence:
    """`entries`: the node's entries in the incidence."""
    row = inc.entry_row()[entries]
    mask = f.use[entries] > 0
    rows = row[mask]
    rest = np.maximum(f.row_rate[rows] - f.rate[node], 0.0)
    return Evidence(rest, inc.user[rows], inc.script[rows], inc.gameable[rows],
                    float(inc.node_hours[node]))


def robust_test(inc: Incidence, ev: Evidence, null: float, spent: bool = False) -> NodeTest:
    """The node's test on all its evidence, then without the failures (the user decided) of
    its most incriminating user and job script, when that source dominates its excess; the
    weakest result stands. ``spent``: the fit already left one source out of this node's
    evidence; one is all a node's test leaves out (with two users each holding half, leaving
    out the second after the first left nothing, and a flaky node was missed)."""
    p, r = test_rate(ev.rest, ev.exposure, null)
    worst = NodeTest(p, r, r * ev.exposure, "", full_p=p)
    if spent or p >= 1.0 or not ev.gameable.any():
        return worst
    share = r / (r + ev.rest) if r > 0 else np.zeros(len(ev.rest))
    excess = (r - null) * ev.exposure
    for key, names, label in ((ev.user, inc.users, "user"), (ev.script, inc.scripts, "script")):
        g = ev.gameable & (key != NO_SCRIPT)
        if not g.any():
            continue
        weight = np.bincount(key[g], weights=share[g])
        top = int(np.argmax(weight))
        if weight[top] < DOMINANT * excess:
            continue  # many sources agree: leaving one out would only discard real evidence
        drop = g & (key == top)
        p2, r2 = test_rate(ev.rest[~drop], ev.exposure, null)
        if p2 > worst.p_value:
            n = int(drop.sum())
            worst = NodeTest(p2, r2, r2 * ev.exposure,
                             f"{n} failure(s) of {label} {names[top]!s} left out", (label, top),
                             p)
    return worst


def source_entries(inc: Incidence, entries: IntArray, source: tuple[str, int]) -> IntArray:
    """Of a node's `entries`, those of failures the user decided that came from `source`."""
    row = inc.entry_row()[entries]
    key = inc.user if source[0] == "user" else inc.script
    out: IntArray = entries[inc.gameable[row] & (key[row] == source[1])]
    return out
