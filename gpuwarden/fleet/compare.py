"""Simulate calibrated fleets and set what the analytics measure beside the paper's figures."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.calibrate import BIG_GPUS, PaperFigures, SimParams
from gpuwarden.accounting.history import from_files, read_events
from gpuwarden.accounting.mttf import MttfReport, report
from gpuwarden.fleet.simulate import Fleet, write_history
from gpuwarden.lemon.scoring import ScoreConfig, score


@dataclass(frozen=True)
class Detection:
    truth: frozenset[str]
    flagged: frozenset[str]

    @property
    def recall(self) -> float:
        return len(self.truth & self.flagged) / len(self.truth) if self.truth else 1.0

    @property
    def precision(self) -> float:
        return len(self.truth & self.flagged) / len(self.flagged) if self.flagged else 1.0


@dataclass(frozen=True)
class Month:
    report: MttfReport
    detection: Detection
    big_fail: float
    lemon_share: float  # of blamed runs, the share that had a true lemon among their nodes
    records: int


def big_fail(att: Attribution) -> float:
    runs = sum(n for g, n in att.gpu_runs.items() if g >= BIG_GPUS)
    fails = sum(n for g, n in att.gpu_failures.items() if g >= BIG_GPUS)
    return fails / runs if runs else 0.0


def run_month(p: SimParams, fleet: Fleet, workdir: Path, cfg: ScoreConfig | None = None,
              progress: Callable[[int, int], None] | None = None) -> Month:
    written = write_history(p, fleet, workdir, progress)
    cfg = cfg or ScoreConfig()
    events = read_events(str(written.events))
    hist = from_files([str(f) for f in written.files], events)
    att = hist.attribution
    flagged = frozenset(s.node for s in score(att, cfg, lemons_only=True))
    truth = frozenset(written.lemons)
    by_node: dict[int | None, set[str]] = {}
    for b in att.blames:
        by_node.setdefault(b.job_id, set()).add(b.node)
    lemon_runs = sum(1 for nodes in by_node.values() if nodes & truth)
    share = lemon_runs / len(by_node) if by_node else 0.0
    rep = report(att, events, p.gpus_per_node, 30.0, (16_384, 131_072))
    return Month(rep, Detection(truth, flagged), big_fail(att), share, hist.records)


@dataclass(frozen=True)
class Row:
    figure: str
    paper: str
    simulated: str


def compare(p: SimParams, nodes: int, days: int, seeds: int, fig: PaperFigures | None = None,
            say: Callable[[str], None] = lambda _: None) -> list[Row]:
    """Per seed: a month with lemons in service, the detector's verdict, then the same fleet for
    a month with the flagged nodes drained. Figures are pooled over the seeds."""
    fig = fig or PaperFigures()
    p16 = p131 = with_l = without = share = frac = 0.0
    hours8 = fails8 = hours1024 = fails1024 = 0.0
    tp = fl = tr = 0
    with tempfile.TemporaryDirectory(prefix="gpuwarden-sim-") as tmp:
        for seed in range(seeds):
            fleet = Fleet(nodes=nodes, days=days, seed=seed)
            say(f"seed {seed}: month 1, lemons in service")
            a = run_month(p, fleet, Path(tmp) / f"s{seed}a")
            say(f"seed {seed}: month 2, {len(a.detection.flagged)} flagged nodes drained")
            b = run_month(p, replace(fleet, exclude=a.detection.flagged,
                                     lemons=tuple(sorted(a.detection.truth))),
                          Path(tmp) / f"s{seed}b")
            # A 2,000-node month is ~110 MB of sacct's JSON: keep one seed's on disk at a time.
            for month in ("a", "b"):
                shutil.rmtree(Path(tmp) / f"s{seed}{month}")
            for c in a.report.classes:
                if c.gpus == 8:
                    hours8 += c.hours
                    fails8 += c.failures
                if c.gpus == 1024:
                    hours1024 += c.hours
                    fails1024 += c.failures
            proj = {pr.gpus: pr.from_node_rate_h or 0.0 for pr in a.report.projections}
            p16 += proj[16_384] / seeds
            p131 += proj[131_072] / seeds
            with_l += a.big_fail / seeds
            without += b.big_fail / seeds
            share += a.lemon_share / seeds
            frac += len(a.detection.truth) / nodes / seeds
            tp += len(a.detection.truth & a.detection.flagged)
            fl += len(a.detection.flagged)
            tr += len(a.detection.truth)
    m8 = hours8 / fails8 / 24 if fails8 else float("inf")
    m1024 = hours1024 / fails1024 if fails1024 else float("inf")
    return [
        Row("MTTF of 8-GPU jobs", f"{fig.mttf_8gpu_days:g} d", f"{m8:.1f} d"),
        Row("MTTF of 1024-GPU jobs", f"{fig.mttf_1024gpu_h:g} h", f"{m1024:.1f} h"),
        Row("projected MTTF, 16,384 GPUs", f"{fig.projection_16k_h:g} h", f"{p16:.2f} h"),
        Row("projected MTTF, 131,072 GPUs", f"{fig.projection_131k_h:g} h", f"{p131:.2f} h"),
        Row("lemon nodes", f"{100 * fig.lemon_fraction:.1f}%", f"{100 * frac:.1f}%"),
        Row(">=512-GPU job failure rate, lemons in service",
            f"{100 * fig.big_fail_with_lemons:.0f}%", f"{100 * with_l:.1f}%"),
        Row(">=512-GPU job failure rate, flagged lemons drained",
            f"{100 * fig.big_fail_without_lemons:.0f}%", f"{100 * without:.1f}%"),
        Row("detector recall / precision", "-",
            f"{tp / tr if tr else 1:.2f} / {tp / fl if fl else 1:.2f}"),
    ]
