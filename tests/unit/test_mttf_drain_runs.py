"""`mttf.drain_runs` finds a drain's failed run by bisection over its node's runs: the same
runs the plain scan of every run of the node finds, for runs of any length around drains at
the edges of the lead and the grace."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from gpuwarden.accounting.attribution import GRACE_S, LEAD_S, Attribution, Blame
from gpuwarden.accounting.mttf import drain_runs, gating_drain_events
from gpuwarden.slurm.models import NodeEvent

T0 = 1_767_225_600
REASON = "gpuwarden: epilog: xid 79 on GPU 0 [health]"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _plain(att: Attribution, events: list[NodeEvent], spans: list[tuple[float, float]],
           grace_s: float) -> list[tuple[str, float, int | None]]:
    runs: dict[str, list[tuple[float, float, int]]] = {}
    for b in att.blames:
        if b.job_id is not None:
            runs.setdefault(b.node, []).append(
                (b.started if b.started is not None else b.at, b.at, b.gpus))
    out = []
    for lo, hi in spans:
        for e, at in gating_drain_events(events, lo, hi):
            hits = [g for s, end, g in runs.get(e.node, ()) if s - LEAD_S <= at <= end + grace_s]
            out.append((e.node, at, max(hits) if hits else None))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_runs_found_around_each_drain_are_the_plain_scans(seed: int) -> None:
    rng = random.Random(seed)
    att = Attribution()
    nodes = [f"n{i}" for i in range(4)]
    for j in range(300):
        start = T0 + rng.randrange(0, 10 * 86_400)
        length = rng.choice([1, 60, 3600, 86_400, 9 * 86_400])  # a few very long runs
        att.blames.append(Blame(rng.choice(nodes), 1.0, j, float(start + length), "r",
                                started=None if rng.random() < 0.1 else float(start),
                                gpus=rng.choice([8, 16, 64])))
    events = []
    for b in rng.sample(att.blames, 60):  # drains at the edges of the lead and the grace
        at = (b.started or b.at) - LEAD_S if rng.random() < 0.5 else b.at + GRACE_S
        at += rng.choice([-1, 0, 1])
        events.append(NodeEvent("c", b.node, _iso(at), _iso(at + 600), "DRAIN", REASON, "root"))
    events += [NodeEvent("c", rng.choice(["n1", "n9"]), _iso(T0 + rng.randrange(0, 10 * 86_400)), "Unknown",
                         "DRAIN", REASON, "root") for _ in range(20)]
    spans = [(float(T0), float(T0 + 5 * 86_400)),
             (float(T0 + 5 * 86_400), float(T0 + 12 * 86_400))]
    got = [(e.node, at, g) for e, at, g in drain_runs(att, events, spans)]
    assert got == _plain(att, events, spans, GRACE_S)
    assert any(g is not None for _, _, g in got) and any(g is None for _, _, g in got)
