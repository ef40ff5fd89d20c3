"""Every figure of the report, from one History read with a `RunTally` collector. Pure.

The page shows only what is here, and `--json` writes all of it (`as_json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from gpuwarden.fleet.mttf import report as mttf_report
from gpuwarden.lemon.history import History
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report import drains, ettr, lemons, mttfview, outcomes, tradeoffs
from gpuwarden.report.collect import RunTally


@dataclass(frozen=True)
class Options:
    source: str  # what was read, in words
    gpus_per_node: int = 8
    ckpt_cost_s: float = 30.0
    interval_h: float = 1.0
    restart_h: float = 0.25
    spares: int = 1
    swap_h: float = 2 / 60
    grace_s: float = 3600.0
    have_topology: bool = False


@dataclass(frozen=True)
class Gating:
    available: bool
    note: str


@dataclass(frozen=True)
class Report:
    generated: str
    source: str
    records: int
    first: str | None
    last: str | None
    span_days: float
    skipped: dict[str, int]
    mttf: mttfview.MttfSection
    outcomes: outcomes.Outcomes
    ettr: ettr.EttrSection
    tradeoffs: list[tradeoffs.Tradeoff]
    lemons: list[lemons.LemonRow]
    drains: drains.Drains
    gating: Gating


GATING = Gating(False, "needs the live cluster: whether health gating is off or its verdicts "
                       "stale is in each node's verdict store and Slurm's node state, not in "
                       "accounting (gpuwarden health status on the nodes)")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build(hist: History, opts: Options, score_cfg: ScoreConfig,
          now: datetime | None = None) -> Report:
    att = hist.attribution
    tally = hist.collected
    if not isinstance(tally, RunTally):
        raise TypeError("the history was read without a report.collect.RunTally")
    rep = mttf_report(att, hist.events, opts.gpus_per_node, opts.ckpt_cost_s,
                      mttfview.PROJECT_TO)
    # Rounded as shown: the page's assumptions are the ones computed with.
    e = ettr.section(rep, ettr.Assumptions(
        round(opts.interval_h, 4), opts.ckpt_cost_s, round(opts.restart_h, 4), opts.spares,
        round(opts.swap_h, 4), opts.gpus_per_node))
    ran = att.last_end > att.first_start
    lo, hi = (att.first_start, att.last_end) if ran else (0.0, 0.0)
    return Report(
        (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ"), opts.source, hist.records,
        _iso(lo) if ran else None, _iso(hi) if ran else None, round((hi - lo) / 86_400, 1),
        dict(sorted(att.skipped.items())), mttfview.section(rep, opts.gpus_per_node),
        outcomes.outcomes(tally, att), e,
        [tradeoffs.checkpoint_vs_redundancy(e),
         tradeoffs.filesystem_vs_object_store(tally, att),
         tradeoffs.proactive_vs_reactive(att, hist.events, opts.grace_s),
         tradeoffs.central_vs_negotiated(tally, opts.have_topology)],
        lemons.lemons(att, score_cfg), drains.drains(hist.events, lo, hi), GATING)


def as_dict(r: Report) -> dict[str, Any]:
    return asdict(r)


def as_json(r: Report) -> str:
    return json.dumps(as_dict(r), indent=1, ensure_ascii=False)
