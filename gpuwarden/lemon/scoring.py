"""Score each node's failures against what the fleet's baseline rate predicts. Pure.

Per node: the failure count k (runs blamed on it, whatever their weight) against its exposure
n (runs it took part in). Fleet baseline p = all blamed node-runs / all node-runs. Under "this
node is like the fleet", k is Poisson(p * n); the p-value is P(X >= k). Benjamini-Hochberg keeps
the false discovery rate across the fleet at `fdr`. A lemon also needs a minimum of evidence
(`min_failures`, `min_jobs`) and a rate at least `min_ratio` times the fleet's.
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


def score(att: Attribution, cfg: ScoreConfig = ScoreConfig()) -> list[NodeScore]:
    """Every node with exposure, most suspicious first."""
    per_node: dict[str, list[Blame]] = defaultdict(list)
    for b in att.blames:
        per_node[b.node].append(b)
    nodes = sorted(set(att.exposure) | set(per_node))
    total_runs = sum(e.jobs for e in att.exposure.values())
    total_failures = sum(len(bs) for bs in per_node.values())
    rate = total_failures / total_runs if total_runs else 0.0
    testable = [n for n in nodes if att.exposure[n].jobs >= cfg.min_jobs]
    p_values = {n: poisson_sf(len(per_node[n]), rate * att.exposure[n].jobs) for n in testable}
    q_values = dict(zip(testable, benjamini_hochberg([p_values[n] for n in testable]), strict=True))
    out = []
    for n in nodes:
        exp = att.exposure[n]
        k = len(per_node[n])
        q = q_values.get(n, 1.0)
        lemon = (n in q_values and k >= cfg.min_failures and q <= cfg.fdr
                 and exp.jobs > 0 and k / exp.jobs >= cfg.min_ratio * rate)
        out.append(NodeScore(
            node=n, jobs=exp.jobs, hours=exp.hours, failures=k,
            blame=sum(b.weight for b in per_node[n]), expected=rate * exp.jobs, fleet_rate=rate,
            p_value=p_values.get(n, 1.0), q_value=q, lemon=lemon,
            evidence=tuple(sorted(per_node[n], key=lambda b: b.at)),
        ))
    out.sort(key=lambda s: (not s.lemon, s.q_value, -s.failures, s.node))
    return out
