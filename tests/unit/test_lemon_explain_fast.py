"""The per-run explanations, computed once over the whole incidence, say what the plain
per-run reading of the fit says, for every node of every failed run; evidence lists are
built when read and equal to building them at once."""

from __future__ import annotations

import random

import numpy as np

from gpuwarden.accounting.attribution import HealthDrain, attribute
from gpuwarden.accounting.incidence import CULPRIT
from gpuwarden.lemon.explain import BACKGROUND, LEFT_OUT, RowView
from gpuwarden.lemon.inference import fit
from gpuwarden.lemon.scoring import score
from gpuwarden.slurm.models import AcctJob

T0 = 1_800_000_000


def gang_history(seed: int) -> tuple[list[AcctJob], list[HealthDrain]]:
    """Contiguous gang jobs on 48 nodes, a lemon at c7, some failures pinned by events."""
    rng = random.Random(seed)
    jobs, drains = [], []
    for jid in range(1500):
        k = rng.choice((1, 2, 4, 8))
        lo = rng.randrange(0, 48 - k + 1)
        nodes = [f"c{i}" for i in range(lo, lo + k)]
        start = T0 + jid * 600
        end = start + 3600
        bad = "c7" in nodes and rng.random() < 0.3
        state = "COMPLETED"
        if bad or rng.random() < 0.02:
            state = rng.choice(("NODE_FAIL", "FAILED"))
            if bad and rng.random() < 0.5:
                drains.append(HealthDrain("c7", end - 30, "gpuwarden: xid 79"))
        jobs.append(AcctJob(jid, "j", rng.choice("ab"), state, "", "gpu", ",".join(nodes),
                            k, 8, 1, None, start - 10, start, end, 0))
    return jobs, drains


def naive_explainer(view: RowView, r: int, node: int) -> str:
    """The per-run reading: nothing if the fit left the run out, else the first other node
    events name, else the other node whose rate explains the most if it beats the background,
    else the background."""
    inc = view.inc
    if view.fit.row_rate[r] <= 0:
        return LEFT_OUT
    lo, hi = int(inc.ptr[r]), int(inc.ptr[r + 1])
    nodes, shares = inc.node[lo:hi], view.share[lo:hi]
    named = [int(n) for n, f in zip(nodes, inc.flags[lo:hi], strict=True)
             if f & CULPRIT and n != node]
    if named:
        return f"{inc.names[named[0]]} (events say it failed)"
    others = shares.copy()
    others[nodes == node] = -1.0
    if len(others) and float(others.max()) >= 1.0 - float(shares.sum()):
        return inc.names[int(nodes[int(np.argmax(others))])]
    return BACKGROUND


def test_every_runs_explainer_matches_the_per_run_reading() -> None:
    jobs, drains = gang_history(seed=3)
    att = attribute(jobs, drains)
    inc = att.incidence.freeze({n: e.hours for n, e in att.exposure.items()})
    view = RowView.of(inc, fit(inc))
    order, bounds = inc.by_node()
    checked = 0
    for node in range(len(inc.names)):
        entries = order[bounds[node]:bounds[node + 1]]
        rows = np.arange(inc.rows)  # every run, with the node or without it
        codes = view.explainers(rows, node).tolist()
        shares = view.node_shares(rows, entries)
        for r in range(inc.rows):
            assert view.label(codes[r]) == naive_explainer(view, r, node)
            lo, hi = int(inc.ptr[r]), int(inc.ptr[r + 1])
            want = float(view.share[lo:hi][inc.node[lo:hi] == node].sum())
            assert shares[r] == want
            checked += 1
    assert checked > 2_000


def test_evidence_is_built_when_read_and_is_the_same_list() -> None:
    jobs, drains = gang_history(seed=4)
    scores = {s.node: s for s in score(attribute(jobs, drains))}
    c7 = scores["c7"]
    assert c7.lemon and len(c7.evidence) == c7.failures
    assert [b.at for b in c7.evidence] == sorted(b.at for b in c7.evidence)
    assert all("on this node" in b.reason for b in c7.evidence)
    assert tuple(c7.evidence) == c7.evidence[:]  # a slice reads the same list
    assert any("explained by c7" in b.reason for s in scores.values() if s.node != "c7"
               for b in s.evidence)
