"""Why the joint fit did or did not put a node's failures on it, in words. Pure."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from gpuwarden.lemon.attribution import Blame
from gpuwarden.lemon.incidence import CULPRIT, NO_JOB, FloatArray, Incidence, IntArray
from gpuwarden.lemon.inference import Fit

BACKGROUND = "the background rate of its job size"


@dataclass(frozen=True)
class RowView:
    """Per failed run: what explains it, from the fit."""

    inc: Incidence
    fit: Fit
    share: FloatArray  # per entry
    row: IntArray  # per entry

    @classmethod
    def of(cls, inc: Incidence, f: Fit) -> RowView:
        return cls(inc, f, f.share(inc), inc.entry_row())

    def explainer(self, r: int, node: int) -> str:
        """What explains run r's failure, when it is not `node`."""
        lo, hi = int(self.inc.ptr[r]), int(self.inc.ptr[r + 1])
        nodes, shares = self.inc.node[lo:hi], self.share[lo:hi]
        culprits = [int(n) for n, fl in zip(nodes, self.inc.flags[lo:hi], strict=True)
                    if fl & CULPRIT and n != node]
        if culprits:
            return f"{self.inc.names[culprits[0]]} (events say it failed)"
        others = shares.copy()
        others[nodes == node] = -1.0
        bg = 1.0 - float(shares.sum())
        if len(others) and float(others.max()) >= bg:
            return self.inc.names[int(nodes[int(np.argmax(others))])]
        return BACKGROUND

    def node_share(self, r: int, node: int) -> float:
        lo, hi = int(self.inc.ptr[r]), int(self.inc.ptr[r + 1])
        hit = self.inc.node[lo:hi] == node
        return float(self.share[lo:hi][hit].sum())


def explain(view: RowView, node: int, entries: IntArray, null: float,
            left_out: str) -> str:
    """One line: how many failed runs, how many the node explains, what explains the rest."""
    rows = view.row[entries]
    if len(rows) == 0:
        return "no failed runs"
    own = float(view.share[entries].sum())
    others: Counter[str] = Counter()
    for r in rows:
        if view.node_share(int(r), node) < 0.5:
            others[view.explainer(int(r), node)] += 1
    expected = null * float(view.inc.node_hours[node])
    parts = [f"{len(rows)} failed run(s) included it; the fit puts {own:.1f} on it "
             f"(a node like the fleet: {expected:.1f})"]
    for who, k in others.most_common(3):
        parts.append(f"{k} of its {len(rows)} failures were in jobs with {who}, which "
                     "explains them" if who != BACKGROUND else
                     f"{k} are explained by {BACKGROUND}")
    if left_out:
        parts.append(f"tested with {left_out} (one source's evidence)")
    return "; ".join(parts)


def annotate(view: RowView, node: int, blames: list[Blame],
             rows_by_job: dict[tuple[int, float], int]) -> list[Blame]:
    """Each blamed run with the node's share of it, or what explains it instead."""
    out = []
    for b in blames:
        r = rows_by_job.get((NO_JOB if b.job_id is None else b.job_id, b.at))
        if r is None:
            out.append(b)
            continue
        s = view.node_share(r, node)
        note = (f"{s:.0%} of it on this node" if s >= 0.5 else
                f"explained by {view.explainer(r, node)} ({s:.0%} on this node)")
        out.append(replace(b, reason=f"{b.reason}; {note}"))
    return out
