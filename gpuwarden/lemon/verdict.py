"""Confirm a lemon: a test that re-optimises what it cannot tell apart, and that no one user
or job script can tip. Pure.

The per-node test in `gpuwarden.lemon.inference` holds every other rate at the fit (a
conditional likelihood ratio). It is cheap and ranks well, but it borrows certainty it does not
have: nodes of a gang block that always run together cannot be told apart by their shared
failures, and one ordinary NODE_FAIL of one of them broke the tie, so the fit put the whole
block's silent failures on it and the conditional test called it certain. So every node that
test would flag is confirmed here, and only what holds here makes a lemon:

1. Profile likelihood ratio. Refit with the node's rate held at the fleet's (the null), every
   other rate and the background re-optimised. Failures the node shares with neighbours it
   cannot be told apart from then move onto them at almost no cost in likelihood: only what
   identifies the node (failures events name it in, runs without its block) stays as evidence.
2. Leave one source's excess out. For each user and each job script that holds more of the
   node's failures (ones the user decided: FAILED, no node named by an event) than its share
   of the fleet's runs predicts (`inference.source_keep`), the fit is refitted with only the
   part within its share of that source's failures on the node, and (1) repeated on that fit
   against that fit's fleet rate. The part is measured again on the refit until it holds:
   measured on the contaminated fit alone, a user's failures raise the node's rate, the fit
   then hands it its block's ordinary failures, and the others' failures the user is measured
   against look larger. The largest p-value stands, so a verdict that one source's failures
   beyond its share tip does not stand; a source holding its share (a script every job runs)
   is not left out at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from gpuwarden.accounting.incidence import CULPRIT, FloatArray, Incidence, IntArray
from gpuwarden.lemon.inference import (
    EXCESS_MIN,
    Evidence,
    Fit,
    SourceKeep,
    evidence,
    fit,
    gamma_p,
    source_keep,
)

# How often a source's kept part is measured again on the refit it gave.
SETTLE = 3


@dataclass(frozen=True)
class Verdict:
    p_value: float  # the largest of the profile tests (all evidence, and each source left out)
    weakest: str  # the source whose leaving out gave it ("" when all evidence did)


def profile_p(inc: Incidence, f: Fit, node: int, null: float,
              keep: FloatArray | None) -> float:
    """One-sided profile likelihood-ratio p-value for "node's rate is above `null`"; ``f``: the
    unconstrained fit with the same ``keep``."""
    if float(f.rate[node]) <= null or inc.node_hours[node] <= 0:
        return 1.0
    g = fit(inc, keep=keep, fixed=(node, null), start=f)
    d = max(0.0, 2 * (f.loglik(inc) - g.loglik(inc)))
    return 0.5 * math.erfc(math.sqrt(d / 2))


@dataclass(frozen=True)
class Bar:
    """What a node's fitted rate must clear before its p-value is worth computing."""

    # A p-value above this cannot make a lemon (a q-value is never below its p), nor can a
    # refits' p-value above it (`simes` is then above it, or the named test's twice alone).
    alpha: float
    min_failures: float
    min_ratio: float
    # A p-value at or below this makes a lemon whatever the other nodes' (a q-value is at most
    # its p times the number of nodes tested): the false discovery rate over that number.
    sure: float = 0.0


def named_counts(inc: Incidence, f: Fit) -> FloatArray:
    """Per node: the failures events name it alone in (no user decides those)."""
    row = inc.entry_row()
    per_row = np.bincount(row[f.use], minlength=inc.rows)  # counted entries per row
    sole = f.use & ((inc.flags & CULPRIT) > 0) & (per_row[row] == 1)
    return np.bincount(inc.node[sole], minlength=len(inc.names)).astype(np.float64)


def named_null(inc: Incidence, counts: FloatArray, keep: list[int]) -> float:
    """The fleet's rate of such failures, pooled over the nodes not found to be lemons."""
    e = float(inc.node_hours[keep].sum())
    return float(counts[keep].sum()) / e if e > 0 else 0.0


def confirm(inc: Incidence, f: Fit, keep: FloatArray, node: int,
            entries: IntArray, null: float, null_of: Callable[[Fit], float],
            bar: Bar, p_first: float, named: tuple[float, float]) -> Verdict:
    """``f``: the fit on ``keep``; ``null``: its fleet rate; ``null_of``: the fleet rate of a
    refit; ``p_first``: the conditional test's p-value (the profile one is never smaller in
    theory; the larger stands, so a poorly converged refit cannot make a node look worse).

    ``named``: the node's count of failures events name it alone in, and the fleet's rate of
    them (`named_counts`, `named_null`): under "the node is like the fleet" that count is
    Poisson(rate x exposure) whatever the other nodes' rates, an exact test no user can tip.
    It and the refits' p-value are combined by Simes's test (`simes`): a node its events
    convict across the fleet (`Bar.sure`) needs no refit, which keeps a fleet of many lemons
    fast (the refits are whole-fleet fits). Only there: a node its events convict on their
    own (below `Bar.alpha`) but not across the fleet was judged on them alone, and a lemon
    that events named in 8 failures was missed where one they named in fewer, tested on its
    silent failures too, was found."""
    sure = convicted(inc, node, bar, named)
    if sure is not None:
        return sure
    mean = named[1] * float(inc.node_hours[node])
    p_named = gamma_p(named[0], mean)
    v = _refits(inc, f, keep, node, entries, null, null_of, bar, p_first)
    # The refits' p-value is asymptotic: on the node's few named failures it is bolder than
    # the exact test of the same failures, and that boldness alone made lemons of ordinary
    # nodes with 4 named failures (0.3 expected). It is put back by the same factor.
    p_refits = min(1.0, v.p_value * small_count_factor(named[0], mean))
    return Verdict(simes(p_named, p_refits), v.weakest)


def simes(p1: float, p2: float) -> float:
    """Simes's combination of two p-values of the same node: the smaller of twice the smaller
    and the larger. Valid where the two tests are positively dependent, as these are (the
    named failures are part of the refits' evidence: both grow with them), which is what
    Benjamini-Hochberg across the fleet already assumes. Bonferroni (twice the smaller)
    charged a lemon both tests called alike a factor of 2 for a choice it did not need:
    held out (20x, gang placement), two lemons with q 0.010 and 0.014 whose named test and
    refits gave 6e-5 to 1e-4 each were missed, in both site styles."""
    lo, hi = min(p1, p2), max(p1, p2)
    return min(1.0, 2 * lo, hi)


def convicted(inc: Incidence, node: int, bar: Bar, named: tuple[float, float]
              ) -> Verdict | None:
    """The verdict where the node's named failures alone convict it across the fleet
    (`Bar.sure`; see `confirm`), None where they do not. Asked before any refit is made for
    the node: at 10M records most lemons are convicted so, and the refit of each that put
    back the source the rounds left out for it (a whole-fleet fit apiece) was most of the
    scan's time, spent on verdicts it could not change."""
    p_named = gamma_p(named[0], named[1] * float(inc.node_hours[node]))
    return Verdict(2 * p_named, "") if 2 * p_named <= bar.sure else None


def small_count_factor(k: float, mean: float) -> float:
    """How much smaller the likelihood ratio's asymptotic p-value for "a Poisson count of k
    is above ``mean``" is than the exact one (1 where it is not): at k = 4 and a mean of 0.3,
    2.4 times."""
    if k <= mean or mean <= 0:
        return 1.0
    d = 2 * (k * math.log(k / mean) - (k - mean))
    p_lrt = 0.5 * math.erfc(math.sqrt(d / 2))
    return max(1.0, gamma_p(k, mean) / p_lrt) if p_lrt > 0 else 1.0


def _refits(inc: Incidence, f: Fit, keep: FloatArray, node: int,
            entries: IntArray, null: float, null_of: Callable[[Fit], float],
            bar: Bar, p_first: float) -> Verdict:
    p = max(p_first, profile_p(inc, f, node, null, keep))
    weakest = ""
    if p > bar.alpha:
        return Verdict(p, weakest)
    ev = evidence(inc, f, node, entries)
    rate = float(f.rate[node])
    for label in ("user", "script"):
        for first in source_keep(inc, ev, rate, label):
            if first.excess < EXCESS_MIN:
                break  # sorted: the rest hold their shares
            g, k2, found = _without(inc, f, keep, node, entries, first)
            null2 = null_of(g)
            r = float(g.rate[node])
            if r * inc.node_hours[node] < bar.min_failures or r < bar.min_ratio * null2:
                p2 = 1.0
            else:
                p2 = profile_p(inc, g, node, null2, k2)
            if p2 > p:
                names = inc.users if label == "user" else inc.scripts
                p, weakest = p2, found.words(names)
            if p > bar.alpha:
                return Verdict(p, weakest)
    return Verdict(p, weakest)


def _without(inc: Incidence, f: Fit, keep: FloatArray, node: int, entries: IntArray,
             first: SourceKeep) -> tuple[Fit, FloatArray, SourceKeep]:
    """The refit with only the kept part of ``first``'s failures on the node, that part
    measured again on the refit until it holds (`SETTLE` times at most)."""
    row = inc.entry_row()[entries]
    key = inc.user if first.label == "user" else inc.script
    mine = entries[inc.gameable[row] & (key[row] == first.index)]
    found, k2, g = first, keep, f
    for _ in range(SETTLE):
        k2 = keep.copy()
        k2[mine] = np.minimum(k2[mine], found.kept)
        g = fit(inc, keep=k2, start=g)
        # Measured with the source's failures counted in full, as `first` was.
        ev = evidence(inc, g, node, entries)
        again = [s for s in source_keep(inc, _whole(ev, first), float(g.rate[node]),
                                        first.label) if s.index == first.index]
        if not again or again[0].kept >= found.kept - 0.01:
            break
        found = again[0]
    return g, k2, found


def _whole(ev: Evidence, source: SourceKeep) -> Evidence:
    """``ev`` with ``source``'s failures the user decided counted in full."""
    key = ev.user if source.label == "user" else ev.script
    mine = ev.gameable & (key == source.index)
    return replace(ev, weight=np.where(mine, 1.0, ev.weights()))
