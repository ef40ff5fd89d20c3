"""Restore the newest step that some tier holds complete and verified. Pure over tiers.

Steps are tried newest first; for each, the tiers fastest first. A copy that fails its
checksums is skipped with a warning naming the tier and shard, and the same step is tried on
the next tier; when no tier has a good copy, restore walks back to the next older step and
says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpuwarden.ckpt.codec import Buf, decode
from gpuwarden.ckpt.fstier import CorruptStep
from gpuwarden.ckpt.manifest import Manifest

log = logging.getLogger(__name__)


class Tier(Protocol):
    name: str

    def steps(self) -> list[int]: ...
    def load(self, step: int) -> tuple[Manifest, dict[str, Buf]]: ...


@dataclass(frozen=True)
class Restored:
    step: int
    tier: str
    state: dict[str, Any]
    manifest: Manifest
    skipped: tuple[str, ...]  # why newer or faster copies were not used


def restore(tiers: Sequence[Tier], at_most: int | None = None) -> Restored | None:
    held = {t.name: set(t.steps()) for t in tiers}
    steps = sorted({s for s in set().union(*held.values()) if at_most is None or s <= at_most},
                   reverse=True)
    skipped: list[str] = []
    for step in steps:
        for t in tiers:
            if step not in held[t.name]:
                continue
            try:
                manifest, data = t.load(step)
            except CorruptStep as exc:
                log.warning("%s; trying the next copy", exc)
                skipped.append(str(exc))
                continue
            state = {s.name: decode(s, data[s.name]) for s in manifest.shards}
            if skipped:
                log.warning("restored step %d from %s after skipping: %s", step, t.name,
                            "; ".join(skipped))
            return Restored(step, t.name, state, manifest, tuple(skipped))
        skipped.append(f"step {step}: no tier holds a verified copy; walking back")
        log.warning("step %d: no tier holds a verified copy; walking back to an older step",
                    step)
    return None
