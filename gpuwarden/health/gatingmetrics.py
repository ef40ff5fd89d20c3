"""Health gating's own series (`gpuwarden_gating.prom`): is gating on, the drains it made by
hook, the drains of its own it resumed, the drains the blast-radius cap refused, and whether a
fault is waiting at the cap now.

The counts live in the state directory (`gating-metrics.json`, root's alone, replaced
atomically under a lock: gpuwarden.core.counterfile), so they survive runs and reboots and
never go backwards; the textfile is written from them. Which event counts as what is decided
here, purely (`event`); gpuwarden.hooks.entry records it and writes the file.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

from gpuwarden.core import counterfile, metrics
from gpuwarden.core.metrics import Metric, Sample
from gpuwarden.slurm.drain import Applied
from gpuwarden.slurm.reasons import ORIGINS, drain_origin

FILE = "gpuwarden_gating.prom"
COUNTS = "gating-metrics.json"
_DRAINS = "drains."  # + the hook
RESUMES, HELD, HELD_NOW = "resumes", "drains_held", "drain_held"


@dataclass(frozen=True)
class Event:
    """What one action of health gating adds to the counts."""

    drain_hook: str = ""  # a drain made (or ranked within the cap after all), by this hook
    resumed: bool = False
    held: bool = False  # the blast-radius cap refused the drain (so a fault waits)

    @property
    def add(self) -> dict[str, float]:
        out = {}
        if self.drain_hook:
            out[_DRAINS + self.drain_hook] = 1.0
        if self.resumed:
            out[RESUMES] = 1.0
        if self.held:
            out[HELD] = 1.0
        return out

    @property
    def put(self) -> dict[str, float]:
        # Whatever gating did, the fault is waiting at the cap only if the cap held it now.
        return {HELD_NOW: 1.0 if self.held else 0.0}


def event(applied: Applied, hook: str, reason: str) -> Event:
    """The counts of ``applied``, done by ``hook`` (one of ORIGINS) on a node whose Slurm
    reason was ``reason`` before. A "kept" drain (made earlier by a run that ended before it
    could rank it, so never counted) counts now, under the hook its reason names."""
    if hook not in ORIGINS:
        raise ValueError(f"hook {hook!r}: expected one of {', '.join(ORIGINS)}")
    if applied.action == "drained":
        return Event(drain_hook=hook)
    if applied.action == "kept":
        return Event(drain_hook=drain_origin(reason) or hook)
    if applied.action == "resumed":
        return Event(resumed=True)
    return Event(held=applied.action == "held" and applied.by_cap)


def record(state_dir: str, ev: Event, wait_s: float = 1.0) -> tuple[dict[str, float], str]:
    """Add ``ev`` to the stored counts: (the counts now, why the old ones were reset or "").
    Raises OSError or StateDirError (then nothing changed)."""
    return counterfile.update(state_dir, COUNTS, ev.add, ev.put, wait_s=wait_s)


def stored(state_dir: str) -> tuple[dict[str, float], str]:
    """The stored counts (none yet: all 0), and why they were reset ("" when they were not).
    Raises StateDirError."""
    return counterfile.read(state_dir, COUNTS)


def held(state_dir: str, wait_s: float = 1.0
         ) -> AbstractContextManager[tuple[dict[str, float], str]]:
    """`stored`, under the counts' lock until the block ends: write the textfile in it, so
    that it never shows counts older than another run (a prolog beside the periodic check)
    wrote there a moment before. Raises StateDirError or OSError."""
    return counterfile.locked(state_dir, COUNTS, wait_s)


def samples(node: str, counts: dict[str, float], enabled: bool) -> dict[Metric, list[Sample]]:
    return {
        metrics.GATING_ENABLED: [((node,), 1.0 if enabled else 0.0)],
        metrics.DRAINS: [((node, hook), counts.get(_DRAINS + hook, 0.0)) for hook in ORIGINS],
        metrics.RESUMES: [((node,), counts.get(RESUMES, 0.0))],
        metrics.DRAINS_HELD: [((node,), counts.get(HELD, 0.0))],
        metrics.DRAIN_HELD: [((node,), counts.get(HELD_NOW, 0.0))],
    }


def write(prom_dir: str, node: str, counts: dict[str, float], enabled: bool) -> None:
    """The textfile, from ``counts``. Raises OSError or a GpuwardenError."""
    metrics.write(prom_dir, FILE, samples(node, counts, enabled))
