"""Which steps retention (`gc`, the writer) and a restart's cleanup may delete. Pure over tiers.

Only a step this rank can read as its own is ever deleted: its manifest verifies and names this
job, rank and step where it was found (the tier checks ownership on the way). A step that is
refused (a damaged or edited manifest, a copy of another job's, rank's or step's, a step that
restore could not use) is left where it is, logged, and never counts toward ``keep``: an operator
may recover it, and what is not ours is not ours to delete. Another user's step directory is
never even listed (`fstier`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Protocol

from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.restore import COPY_ERRORS

log = logging.getLogger(__name__)


class Listing(Protocol):
    name: str

    def steps(self) -> list[int]: ...
    def manifest(self, step: int) -> Manifest: ...


def readable(tier: Listing, steps: Iterable[int],
             refused: Collection[tuple[str, int]] = ()) -> tuple[list[int], list[int]]:
    """``steps`` split into those whose manifest verifies on ``tier`` and those left in place
    (logged): a manifest refused now, or a copy restore refused (``refused``: (tier, step))."""
    ok: list[int] = []
    kept: list[int] = []
    for s in sorted(steps):
        why = "restore could not use it" if (tier.name, s) in refused else ""
        if not why:
            try:
                tier.manifest(s)
            except COPY_ERRORS as exc:
                why = str(exc)
        if why:
            log.warning("%s: leaving step %d in place (never deleted: an operator may recover "
                        "it): %s", tier.name, s, why)
            kept.append(s)
        else:
            ok.append(s)
    return ok, kept


def to_delete(tier: Listing, keep: int, protect: Collection[int] = (),
              floor: int | None = None) -> tuple[list[int], list[int]]:
    """The steps beyond the newest ``keep`` readable ones, except ``protect`` and any step from
    ``floor`` on; and the steps left in place because they cannot be read."""
    if keep < 1:
        raise ValueError("keep must be at least 1: a tier's newest step is never deleted")
    ok, kept = readable(tier, tier.steps())
    old = ok[:-keep]
    return [s for s in old if s not in protect and (floor is None or s < floor)], kept
