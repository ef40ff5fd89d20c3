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
2. Leave one source out. For each user and each job script whose failures (ones the user
   decided: FAILED, no node named by an event) are among the node's evidence, the fit is
   refitted without all of that source's such failures, and (1) repeated on that fit against
   that fit's fleet rate. Measuring a source's weight on the contaminated fit is not enough: a
   user's failures raise the node's rate, the fit then hands it its block's ordinary failures,
   and the user's own share looks small. The largest p-value stands, so a verdict that one
   source's failures tip does not stand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuwarden.accounting.incidence import CULPRIT, NO_SCRIPT, FloatArray, Incidence, IntArray
from gpuwarden.lemon.inference import Fit, fit, gamma_p


@dataclass(frozen=True)
class Verdict:
    p_value: float  # the largest of the profile tests (all evidence, and each source left out)
    weakest: str  # the source whose leaving out gave it ("" when all evidence did)


def profile_p(inc: Incidence, f: Fit, node: int, null: float,
              drop: npt.NDArray[np.bool_] | None) -> float:
    """One-sided profile likelihood-ratio p-value for "node's rate is above `null`"; ``f``: the
    unconstrained fit with the same ``drop``."""
    if float(f.rate[node]) <= null or inc.node_hours[node] <= 0:
        return 1.0
    g = fit(inc, drop=drop, fixed=(node, null), start=f)
    d = max(0.0, 2 * (f.loglik(inc) - g.loglik(inc)))
    return 0.5 * math.erfc(math.sqrt(d / 2))


@dataclass(frozen=True)
class Bar:
    """What a node's fitted rate must clear before its p-value is worth computing."""

    alpha: float  # a p-value above this cannot make a lemon (a q-value is never below its p)
    min_failures: float
    min_ratio: float


def named_counts(inc: Incidence, f: Fit) -> FloatArray:
    """Per node: the failures events name it alone in (no user decides those)."""
    row = inc.entry_row()
    per_row = np.bincount(row, weights=f.use, minlength=inc.rows)
    sole = (f.use > 0) & ((inc.flags & CULPRIT) > 0) & (per_row[row] == 1)
    return np.bincount(inc.node[sole], minlength=len(inc.names)).astype(np.float64)


def named_null(inc: Incidence, counts: FloatArray, keep: list[int]) -> float:
    """The fleet's rate of such failures, pooled over the nodes not found to be lemons."""
    e = float(inc.node_hours[keep].sum())
    return float(counts[keep].sum()) / e if e > 0 else 0.0


def confirm(inc: Incidence, f: Fit, drop: npt.NDArray[np.bool_], node: int,
            entries: IntArray, null: float, null_of: Callable[[Fit], float],
            bar: Bar, p_first: float, named: tuple[float, float]) -> Verdict:
    """``f``: the fit on ``drop``; ``null``: its fleet rate; ``null_of``: the fleet rate of a
    refit; ``p_first``: the conditional test's p-value (the profile one is never smaller in
    theory; the larger stands, so a poorly converged refit cannot make a node look worse).

    ``named``: the node's count of failures events name it alone in, and the fleet's rate of
    them (`named_counts`, `named_null`): under "the node is like the fleet" that count is
    Poisson(rate x exposure) whatever the other nodes' rates, an exact test no user can tip.
    It and the refits' p-value are combined by Bonferroni (twice the smaller): a node its
    events convict needs no refit, which keeps a fleet of many lemons fast (the refits are
    whole-fleet fits)."""
    p_named = gamma_p(named[0], named[1] * float(inc.node_hours[node]))
    if 2 * p_named <= bar.alpha:
        return Verdict(2 * p_named, "")
    v = _refits(inc, f, drop, node, entries, null, null_of, bar, p_first)
    return Verdict(min(1.0, 2 * min(p_named, v.p_value)), v.weakest)


def _refits(inc: Incidence, f: Fit, drop: npt.NDArray[np.bool_], node: int,
            entries: IntArray, null: float, null_of: Callable[[Fit], float],
            bar: Bar, p_first: float) -> Verdict:
    p = max(p_first, profile_p(inc, f, node, null, drop))
    weakest = ""
    if p > bar.alpha / 2:
        return Verdict(p, weakest)
    all_rows = inc.entry_row()
    rows = all_rows[entries][f.use[entries] > 0]
    rows = rows[inc.gameable[rows]]
    for key, names, label in ((inc.user, inc.users, "user"), (inc.script, inc.scripts, "script")):
        values, counts = np.unique(key[rows], return_counts=True)
        for i in np.argsort(-counts, kind="stable"):
            value = int(values[i])
            if value == NO_SCRIPT:
                continue
            out = inc.gameable[all_rows] & (key[all_rows] == value)
            d2 = drop | out
            g = fit(inc, drop=d2, start=f)
            null2 = null_of(g)
            rate = float(g.rate[node])
            if rate * inc.node_hours[node] < bar.min_failures or rate < bar.min_ratio * null2:
                p2 = 1.0
            else:
                p2 = profile_p(inc, g, node, null2, d2)
            if p2 > p:
                p, weakest = p2, f"{label} {names[value]!s} ({int(counts[i])} failure(s)) left out"
            if p > bar.alpha / 2:
                return Verdict(p, weakest)
    return Verdict(p, weakest)
