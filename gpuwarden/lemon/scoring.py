"""Score each node's failures against what the fleet's baseline rate predicts. Pure.

Per node: failure counts against what the fleet predicts for its exposure: for each run size
(node count, in powers of two) the fleet's share of blamed node-runs of that size, times the
node's runs of that size, summed (plus the fleet's rate of drains with no run behind them). Big
runs fail more often, so a node that took part in many of them is expected to see more
failures. Pinned and spread failures are counted apart (see `score`). Under "this node is like
the fleet", each count is Poisson(expected); the p-value is P(X >= k). Benjamini-Hochberg keeps
the false discovery rate across the fleet at `fdr`. A lemon also needs a minimum of evidence
(`min_failures`, `min_jobs`) and at least `min_ratio` times its expected failures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from gpuwarden.accounting.aside import Aside
from gpuwarden.accounting.attribution import Attribution, Exposure
from gpuwarden.accounting.blames import Blame, Blames
from gpuwarden.accounting.gcpause import paused
from gpuwarden.accounting.incidence import (
    FloatArray,
    Incidence,
    IndexArray,
    IntArray,
    grouped,
)
from gpuwarden.lemon.explain import LazyEvidence, RowIndex, RowView, annotate, explain
from gpuwarden.lemon.inference import (
    Fit,
    NodeTest,
    fit,
    node_evidence,
    ready,
    release,
    robust_test,
    source_entries,
)
from gpuwarden.lemon.verdict import Bar, confirm, convicted, named_counts, named_null

ROUNDS = 6


@dataclass(frozen=True)
class ScoreConfig:
    fdr: float = 0.01
    min_failures: int = 3
    min_jobs: int = 10
    min_ratio: float = 3.0


@dataclass(frozen=True)
class NodeScore:
    node: str
    jobs: int
    hours: float
    failures: int
    blame: float
    expected: float
    fleet_rate: float
    p_value: float
    q_value: float
    lemon: bool
    evidence: Sequence[Blame]  # by time; built when first read (`LazyEvidence`)
    attributed: float = 0.0  # failures the joint fit puts on the node (on the evidence that stood)
    explanation: str = ""  # why it was or was not blamed (suspects and lemons)

    @property
    def summary(self) -> str:
        return (f"lemon, {self.failures} of {self.jobs} jobs failed, "
                f"fleet rate {100 * self.fleet_rate:.1f}%")


def poisson_sf(k: int, lam: float) -> float:
    """P(X >= k) for X ~ Poisson(lam), accurate in both tails."""
    if k <= 0:
        return 1.0
    if lam <= 0:
        return 0.0
    if k > lam:
        # Upper tail directly: terms shrink geometrically past the mean.
        term = math.exp(-lam + k * math.log(lam) - math.lgamma(k + 1))
        total, i = term, k
        while term > total * 1e-17:
            i += 1
            term *= lam / i
            total += term
        return min(1.0, total)
    # Below the mean: one minus the (small) lower tail P(X <= k-1).
    term = math.exp(-lam)
    lower = term
    for i in range(1, k):
        term *= lam / i
        lower += term
    return max(0.0, 1.0 - lower)


def benjamini_hochberg(p_values: list[float]) -> list[float]:
    """q-values, in the input order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    q = [1.0] * m
    running = 1.0
    for rank, i in reversed(list(enumerate(order, 1))):
        running = min(running, p_values[i] * m / rank)
        q[i] = running
    return q


def _expected(att: Attribution, failed: dict[int, int], lone: int) -> dict[str, float]:
    rate = {b: failed.get(b, 0) / runs for b, runs in att.runs_by_size.items() if runs}
    total_runs = sum(att.runs_by_size.values())
    lone_rate = lone / total_runs if total_runs else 0.0
    return {n: sum(rate.get(b, 0.0) * k for b, k in e.by_size.items()) + lone_rate * e.jobs
            for n, e in att.exposure.items()}


def expected_failures(att: Attribution) -> dict[str, float]:
    """What the fleet's rates predict for each node's exposure (pinned and spread together)."""
    lone = att.blames.lone()
    failed = att.pinned_by_size + att.spread_by_size
    return _expected(att, dict(failed), lone)


def _null_rate(f: Fit, inc: Incidence, keep: list[int]) -> float:
    """The fleet's rate: pooled over the nodes not (yet) found to be lemons."""
    if not keep:
        return 0.0
    e = inc.node_hours[keep]
    return float((f.rate[keep] * e).sum() / e.sum()) if e.sum() > 0 else 0.0


@paused()  # a NodeScore and its evidence per node, per-node lists of a million blames
def score(att: Attribution, cfg: ScoreConfig = ScoreConfig(),
          lemons_only: bool = False) -> list[NodeScore]:
    """Every node with exposure, most suspicious first; ``lemons_only``: only the lemons, the
    same as they are among every node's (the report's: no explanation written for the other
    nodes, a second each at a year).

    The rates come from the joint fit (`gpuwarden.lemon.inference`): every failed run is
    explained by all of its nodes at once, so a node that only fails alongside a lemon is not
    blamed for it. Each testable node is tested against the fleet's rate (pooled over the nodes
    not found to be lemons, refitted until the set holds), with what its user and its job
    script holding the most beyond their shares of the fleet's runs hold beyond them left out
    in turn; Benjamini-Hochberg runs
    across the fleet.
    """
    blames = att.blames
    per_node = _by_node(blames)
    nodes = sorted(set(att.exposure) | set(per_node))
    exposure = {n: att.exposure.get(n) or Exposure() for n in nodes}
    total_runs = sum(e.jobs for e in exposure.values())
    rate = len(blames) / total_runs if total_runs else 0.0
    inc = att.incidence.freeze({n: e.hours for n, e in exposure.items()})
    index = {n: i for i, n in enumerate(inc.names)}
    order, bounds = inc.by_node()
    entries = {n: order[bounds[index[n]]:bounds[index[n] + 1]] for n in nodes}
    testable = [n for n in nodes if exposure[n].jobs >= cfg.min_jobs]
    r = _rounds(inc, cfg, index, entries, testable)
    release(inc)
    f, tests, q_values, flagged, null = r.fit, r.tests, r.q_values, r.flagged, r.null
    view = RowView.of(inc, f)
    rows_by_job = RowIndex(inc)
    out = []
    # Per run (not per blame: 8 million at a year) its time, and per blame its run.
    at = np.frombuffer(blames.at, dtype=np.float64)
    run = np.frombuffer(blames.run, dtype=np.int32)
    for n in nodes:
        lemon = n in flagged
        if lemons_only and not lemon:
            continue
        i = index[n]
        t = tests.get(n)
        # The node's blames by time (stable: in the order they were added at a tie).
        mine = per_node.get(n, _NONE)
        mine = mine[np.argsort(at[run[mine]], kind="stable")]
        shown = len(entries[n]) > 0
        out.append(NodeScore(
            node=n, jobs=exposure[n].jobs, hours=exposure[n].hours, failures=len(mine),
            blame=float(f.rate[i] * inc.node_hours[i]), expected=null * float(inc.node_hours[i]),
            fleet_rate=rate, p_value=t.p_value if t else 1.0, q_value=q_values.get(n, 1.0),
            lemon=lemon,
            evidence=LazyEvidence(partial(_evidence, view, i, blames, mine, rows_by_job,
                                          entries[n]))
            if shown else tuple(blames.at_rows(mine.tolist())),
            attributed=t.attributed if t else float(f.rate[i] * inc.node_hours[i]),
            explanation=explain(view, i, entries[n], null, _left_out(r, n, t, cfg),
                                t.attributed if t else None)
            if shown else "",
        ))
    out.sort(key=lambda s: (not s.lemon, s.q_value, -s.failures, s.node))
    return out


def _left_out(r: _Rounds, n: str, t: NodeTest | None, cfg: ScoreConfig) -> str:
    """Which source the node was tested without, where that mattered: a node whose whole
    evidence was no case against it is not said to have had any left out."""
    if n in r.left_out:
        return r.left_out[n]
    return t.left_out if t and min(t.full_p, t.p_value) <= cfg.fdr else ""


_NONE = np.zeros(0, dtype=np.int64)


def _by_node(blames: Blames) -> dict[str, IndexArray]:
    """Per node blamed, the places of its blames (ascending; `index_dtype`)."""
    codes = np.frombuffer(blames.node, dtype=np.int32) if len(blames) else _NONE
    order = grouped(codes, len(blames.names))
    bounds = np.searchsorted(codes[order], np.arange(len(blames.names) + 1))
    return {n: order[bounds[k]:bounds[k + 1]] for k, n in enumerate(blames.names)
            if bounds[k + 1] > bounds[k]}


def _evidence(view: RowView, node: int, blames: Blames, mine: IntArray, rows_by_job: RowIndex,
              entries: IntArray) -> Sequence[Blame]:
    return annotate(view, node, blames, mine, rows_by_job, entries)


@dataclass(frozen=True, eq=False)
class _Rounds:
    fit: Fit
    tests: dict[str, NodeTest]
    q_values: dict[str, float]
    flagged: set[str]
    null: float
    left_out: dict[str, str]  # per node: the dominant source its evidence was tested without


SPLIT_AT = 2_000  # testable nodes from which half their tests go to a forked child


def _tested(inc: Incidence, f: Fit, null: float, index: dict[str, int],
            entries: dict[str, IntArray], nodes: Sequence[str],
            left_out: dict[str, str]) -> dict[str, NodeTest]:
    # ``entries`` are each node's entries in `Incidence.by_node` (`score`).
    return {n: robust_test(inc, node_evidence(inc, f, index[n], entries[n]), null,
                           spent=n in left_out) for n in nodes}


def _tests(inc: Incidence, f: Fit, null: float, index: dict[str, int],
           entries: dict[str, IntArray], testable: list[str],
           left_out: dict[str, str]) -> dict[str, NodeTest]:
    """Each testable node's `robust_test`, in ``testable``'s order: on a big fleet the second
    half in a forked child (`accounting.aside`: each test reads only the fit's arrays), on a
    second core."""
    if len(testable) < SPLIT_AT:
        return _tested(inc, f, null, index, entries, testable, left_out)
    half = len(testable) // 2
    ready(inc, f)  # the nodes' slices, made once for both
    rest = Aside(partial(_tested, inc, f, null, index, entries, testable[half:], left_out))
    first = _tested(inc, f, null, index, entries, testable[:half], left_out)
    return first | rest.result()


def _rounds(inc: Incidence, cfg: ScoreConfig, index: dict[str, int],
            entries: dict[str, IntArray], testable: list[str]) -> _Rounds:
    """Fit, test, and again until the lemons and the left-out sources hold.

    What a source holds beyond its share on a node that it would make a lemon is left out of
    the fit as well as of the node's test (sticky, only ever less kept, so the rounds end):
    kept in the fit, a broken partition's failures made its nodes explain their neighbours'
    failures in every big job they shared, and raised the fleet's rate that every node is
    tested against. It is the one source that node's test leaves out (`robust_test`'s
    ``spent``).
    """
    keep = np.ones(len(inc.node))
    left_out: dict[str, str] = {}
    own: dict[str, IntArray] = {}  # per node: the entries of the source left out for it
    f = fit(inc)
    flagged: set[str] = set()
    tests: dict[str, NodeTest] = {}
    q_values: dict[str, float] = {}
    null = 0.0
    for _ in range(ROUNDS):
        null = _null_rate(f, inc, [index[n] for n in index if n not in flagged])
        tests = _tests(inc, f, null, index, entries, testable, left_out)
        q_values = dict(zip(testable, benjamini_hochberg([tests[n].p_value for n in testable]),
                            strict=True))
        now = {n for n in testable if q_values[n] <= cfg.fdr
               and tests[n].attributed >= cfg.min_failures
               and tests[n].rate >= cfg.min_ratio * null}
        # Only where the evidence would make a lemon: elsewhere a source is a small part of
        # little, and taking it out of the fit would only move ordinary failures about.
        q_all = benjamini_hochberg([tests[n].full_p for n in testable])
        grown = False
        for n, q in zip(testable, q_all, strict=True):
            source = tests[n].source
            if source is not None and q <= cfg.fdr:
                hit = source_entries(inc, entries[n], source)
                kept = tests[n].kept
                if (keep[hit] > kept + 1e-6).any():
                    keep[hit] = np.minimum(keep[hit], kept)
                    left_out[n] = tests[n].left_out
                    own[n] = hit
                    grown = True
        if now == flagged and not grown:
            break
        flagged = now
        if grown:
            f = fit(inc, keep=keep, start=f)
    tests, q_values, flagged = _confirm(inc, cfg, index, entries, testable, f, keep, own, null,
                                        tests, flagged)
    return _Rounds(f, tests, q_values, flagged, null, left_out)


def _confirm(inc: Incidence, cfg: ScoreConfig, index: dict[str, int],
             entries: dict[str, IntArray], testable: list[str], f: Fit,
             weights: FloatArray, own: dict[str, IntArray], null: float,
             tests: dict[str, NodeTest], flagged: set[str]
             ) -> tuple[dict[str, NodeTest], dict[str, float], set[str]]:
    """Only what the profile test, and the same with any one user or job script left out,
    confirms makes a lemon (`gpuwarden.lemon.verdict`); the rest of the fleet keeps its
    conditional p-values (never larger), so the candidates' q-values are not flattered. The
    source the rounds left out for a node is put back first: it is one of the sources its
    confirmation leaves out in turn, and leaving out two (each user of two, half each) left a
    flaky node with no evidence."""
    keep = [index[n] for n in index if n not in flagged]
    bar = Bar(cfg.fdr, cfg.min_failures, cfg.min_ratio, cfg.fdr / max(len(testable), 1))
    counts = named_counts(inc, f)
    named_rate = named_null(inc, counts, keep)
    tests = dict(tests)
    for n in sorted(flagged):
        t = tests[n]
        named = (float(counts[index[n]]), named_rate)
        v = convicted(inc, index[n], bar, named)
        if v is None:
            base, start = weights, f
            if n in own:
                base = weights.copy()
                base[own[n]] = 1.0
                start = fit(inc, keep=base, start=f)
            v = confirm(inc, start, base, index[n], entries[n], _null_rate(start, inc, keep),
                        partial(_null_rate, inc=inc, keep=keep), bar, t.p_value, named)
        tests[n] = replace(t, p_value=v.p_value, left_out=v.weakest or t.left_out)
    q_values = dict(zip(testable, benjamini_hochberg([tests[n].p_value for n in testable]),
                        strict=True))
    return tests, q_values, {n for n in flagged if q_values[n] <= cfg.fdr}
