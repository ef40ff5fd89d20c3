"""Lemon nodes with their evidence: `lemon.scoring.score` as `lemon scan` runs it. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.lemon.scoring import ScoreConfig, score


@dataclass(frozen=True)
class Evidence:
    at: str  # UTC
    job_id: int | None
    reason: str
    weight: float


@dataclass(frozen=True)
class LemonRow:
    node: str
    jobs: int
    failures: int
    expected: float  # the fleet's rate times the node's exposure
    attributed: float  # failures the joint fit puts on the node
    q_value: float
    summary: str
    explanation: str
    evidence: list[Evidence]


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def lemons(att: Attribution, cfg: ScoreConfig) -> list[LemonRow]:
    return [LemonRow(s.node, s.jobs, s.failures, round(s.expected, 2), round(s.attributed, 2),
                     float(f"{s.q_value:.3g}"), s.summary, s.explanation,
                     [Evidence(_when(b.at), b.job_id, b.reason, round(b.weight, 3))
                      for b in s.evidence])
            for s in score(att, cfg) if s.lemon]
