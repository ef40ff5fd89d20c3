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
from collections import defaultdict
from dataclasses import dataclass

from gpuwarden.lemon.attribution import Attribution, Blame


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
    evidence: tuple[Blame, ...]

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
    lone = sum(1 for b in att.blames if b.job_id is None)
    failed = att.pinned_by_size + att.spread_by_size
    return _expected(att, dict(failed), lone)


def score(att: Attribution, cfg: ScoreConfig = ScoreConfig()) -> list[NodeScore]:
    """Every node with exposure, most suspicious first.

    Two counts per node, each against its own expectation: failures pinned on the node (the
    sharp evidence), and gang-job failures spread over all of a job's nodes (weak one by one,
    but a node in every failing gang job stands out). The node's p-value is the smaller of the
    two, doubled (Bonferroni over the pair); Benjamini-Hochberg then runs across the fleet.
    """
    per_node: dict[str, list[Blame]] = defaultdict(list)
    for b in att.blames:
        per_node[b.node].append(b)
    nodes = sorted(set(att.exposure) | set(per_node))
    total_runs = sum(e.jobs for e in att.exposure.values())
    rate = len(att.blames) / total_runs if total_runs else 0.0
    lone = sum(1 for b in att.blames if b.job_id is None)
    exp_pinned = _expected(att, dict(att.pinned_by_size), lone)
    exp_spread = _expected(att, dict(att.spread_by_size), 0)
    testable = [n for n in nodes if att.exposure[n].jobs >= cfg.min_jobs]
    p_values: dict[str, float] = {}
    strong: dict[str, tuple[int, float]] = {}  # the family that gave the p-value: (k, expected)
    for n in testable:
        k_pin = sum(1 for b in per_node[n] if b.pinned)
        k_spread = len(per_node[n]) - k_pin
        e_pin, e_spread = exp_pinned.get(n, 0.0), exp_spread.get(n, 0.0)
        p_pin, p_spread = poisson_sf(k_pin, e_pin), poisson_sf(k_spread, e_spread)
        p_values[n] = min(1.0, 2 * min(p_pin, p_spread))
        strong[n] = (k_pin, e_pin) if p_pin <= p_spread else (k_spread, e_spread)
    q_values = dict(zip(testable, benjamini_hochberg([p_values[n] for n in testable]), strict=True))
    out = []
    for n in nodes:
        exp = att.exposure[n]
        k = len(per_node[n])
        q = q_values.get(n, 1.0)
        mean = exp_pinned.get(n, 0.0) + exp_spread.get(n, 0.0)
        k_fam, e_fam = strong.get(n, (0, 0.0))
        lemon = (n in q_values and k >= cfg.min_failures and q <= cfg.fdr
                 and k_fam >= cfg.min_ratio * e_fam)
        out.append(NodeScore(
            node=n, jobs=exp.jobs, hours=exp.hours, failures=k,
            blame=sum(b.weight for b in per_node[n]), expected=mean, fleet_rate=rate,
            p_value=p_values.get(n, 1.0), q_value=q, lemon=lemon,
            evidence=tuple(sorted(per_node[n], key=lambda b: b.at)),
        ))
    out.sort(key=lambda s: (not s.lemon, s.q_value, -s.failures, s.node))
    return out
