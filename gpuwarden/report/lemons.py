"""Lemon nodes with their evidence: `lemon.scoring.score` as `lemon scan` runs it. Pure."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.blames import Blame
from gpuwarden.lemon.explain import LazyEvidence
from gpuwarden.lemon.scoring import ScoreConfig, score


@dataclass(frozen=True, slots=True)  # 1.4 million in a year's report
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


_LAST_S = 253_402_300_800  # 10000-01-01: numpy writes the years before it as strftime does


def _whens(ts: list[float]) -> list[str]:
    """`_when` of each, whole seconds from 1970 on written by numpy at once: a year's lemons
    hold 1.4 million pieces of evidence, and strftime each took 6 s."""
    a = np.array(ts, dtype=np.float64)
    fast = (a >= 0) & (a < _LAST_S) & (a == np.floor(a))
    out = [""] * len(ts)
    if fast.any():
        got = np.datetime_as_string(a[fast].astype(np.int64).astype("datetime64[s]"), unit="s")
        for k, text in zip(np.flatnonzero(fast).tolist(), got.tolist(), strict=True):
            out[k] = text + "Z"
    for k in np.flatnonzero(~fast).tolist():
        out[k] = _when(ts[k])
    return out


# Each slot's own setter: what the dataclass's __init__ reaches through object.__setattr__
# (a frozen field), at twice the cost (`blames._SET`).
_SET = tuple(getattr(Evidence, f).__set__ for f in Evidence.__slots__)


def _evidence(pieces: Iterable[tuple[float, int | None, str, float]],
              _new: Callable[[type[Evidence]], Evidence] = object.__new__,
              _set: tuple[Callable[[Evidence, object], None], ...] = _SET) -> list[Evidence]:
    """Each piece as Evidence, its slots filled directly: a year's lemons hold 1.4 million."""
    got = list(pieces)
    whens = _whens([at for at, _, _, _ in got])
    s_at, s_job, s_reason, s_weight = _set
    out: list[Evidence] = []
    add = out.append
    for w, (_, job, reason, weight) in zip(whens, got, strict=True):
        e = _new(Evidence)
        s_at(e, w)
        s_job(e, job)
        s_reason(e, reason)
        s_weight(e, round(weight, 3))
        add(e)
    return out


def _pieces(evidence: Sequence[Blame]) -> Iterable[tuple[float, int | None, str, float]]:
    if isinstance(evidence, LazyEvidence):
        return evidence.pieces()  # no Blame made for each
    return ((b.at, b.job_id, b.reason, b.weight) for b in evidence)


def lemons(att: Attribution, cfg: ScoreConfig) -> list[LemonRow]:
    return [LemonRow(s.node, s.jobs, s.failures, round(s.expected, 2), round(s.attributed, 2),
                     float(f"{s.q_value:.3g}"), s.summary, s.explanation,
                     _evidence(_pieces(s.evidence)))
            for s in score(att, cfg, lemons_only=True)]
