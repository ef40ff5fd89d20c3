"""Lemon nodes with their evidence: `lemon.scoring.score` as `lemon scan` runs it. Pure."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import repeat
from typing import Any

import numpy as np

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.blames import Blame
from gpuwarden.accounting.incidence import NO_JOB, FloatArray
from gpuwarden.lemon.explain import Columns, LazyEvidence
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


def _whens(ts: list[float] | FloatArray) -> list[str]:
    """`_when` of each, whole seconds from 1970 on written by numpy at once: a year's lemons
    hold 1.4 million pieces of evidence, and strftime each took 6 s."""
    a = np.asarray(ts, dtype=np.float64)
    fast = (a >= 0) & (a < _LAST_S) & (a == np.floor(a))
    if fast.all():
        if not len(a):
            return []
        texts: list[str] = np.char.add(_seconds(a), "Z").tolist()
        return texts
    out = [""] * len(a)
    if fast.any():
        got = _seconds(a[fast])
        for k, text in zip(np.flatnonzero(fast).tolist(), got.tolist(), strict=True):
            out[k] = text + "Z"
    for k in np.flatnonzero(~fast).tolist():
        out[k] = _when(float(a[k]))
    return out


def _seconds(a: FloatArray) -> np.ndarray:
    return np.datetime_as_string(a.astype(np.int64).astype("datetime64[s]"), unit="s")


def _rounded(weight: FloatArray) -> list[float]:
    """``round(w, 3)`` of each, once for each distinct value (by its bits: -0.0 stays -0.0):
    a year's lemons hold 1.4 million pieces of 8 weights, and each round took a
    microsecond."""
    bits = np.ascontiguousarray(weight, dtype=np.float64).view(np.int64)
    _, first, inv = np.unique(bits, return_index=True, return_inverse=True)
    each = np.empty(len(first), dtype=object)
    each[:] = [round(w, 3) for w in weight[first].tolist()]
    out: list[float] = each[inv.reshape(-1)].tolist()
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


def _columns(c: Columns, _new: Callable[[type[Evidence]], Evidence] = object.__new__,
             _set: tuple[Callable[[Evidence, object], None], ...] = _SET) -> list[Evidence]:
    """`_evidence` of a node's evidence read as columns (`LazyEvidence.columns`): each
    field's Python values made at once."""
    whens = _whens(c.at)
    jobs: list[int | None] = c.job.tolist()
    for k in np.flatnonzero(c.job == NO_JOB).tolist():
        jobs[k] = None
    reasons, weights = c.reason, _rounded(c.weight)
    if not len(whens) == len(jobs) == len(reasons) == len(weights):
        raise ValueError("evidence columns of unequal lengths")
    # Made at once, then each field set over them all: `map` runs the loops in C.
    out: list[Evidence] = list(map(_new, repeat(Evidence, len(whens))))
    done = deque[None](maxlen=0).extend
    columns: tuple[list[Any], ...] = (whens, jobs, reasons, weights)
    for setter, values in zip(_set, columns, strict=True):
        done(map(setter, out, values))
    return out


def _pieces(evidence: Sequence[Blame]) -> Iterable[tuple[float, int | None, str, float]]:
    if isinstance(evidence, LazyEvidence):
        return evidence.pieces()  # no Blame made for each
    return ((b.at, b.job_id, b.reason, b.weight) for b in evidence)


def _read(evidence: Sequence[Blame]) -> list[Evidence]:
    if isinstance(evidence, LazyEvidence):
        c = evidence.columns()
        if c is not None:
            return _columns(c)
    return _evidence(_pieces(evidence))


def lemons(att: Attribution, cfg: ScoreConfig) -> list[LemonRow]:
    return [LemonRow(s.node, s.jobs, s.failures, round(s.expected, 2), round(s.attributed, 2),
                     float(f"{s.q_value:.3g}"), s.summary, s.explanation,
                     _read(s.evidence))
            for s in score(att, cfg, lemons_only=True)]
