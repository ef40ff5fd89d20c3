"""Restore the newest step that some tier holds complete and verified. Pure over tiers.

Every tier is listed first, each on its own: a tier that cannot be listed (S3 unreachable, a
job directory another user planted) is noted and the others are used. Steps are then tried
newest first and, for each, the tiers fastest first. A copy that cannot be used, whatever the
reason (a checksum, a manifest that fails validation or names another job, rank or step, a
shard that is a FIFO or a link, a dtype that does not decode, a manifest nested too deeply, an
I/O error), is skipped with a warning naming the tier and why, and the same step is tried on the
next tier; when no tier has a good copy, restore walks back to the next older step and says so.

The contract of `restore`:

* returns `Restored` for the newest step (at most ``at_most``) that some tier holds verified;
  ``Restored.step == Restored.manifest.step`` always (a manifest is used only for the step
  where it was found), and ``skipped`` says why newer or faster copies were not used;
* returns None when every tier was listed and none holds a usable step: start fresh;
* raises `TiersUnavailable` (a `TierError`) when nothing could be restored and some tier could
  not be listed: it may hold the step, and starting fresh would throw the job's progress away;
* raises nothing else for what a tier holds or returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwarden.ckpt import nested
from gpuwarden.ckpt.codec import decode
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.tier import Tier, TierError
from gpuwarden.core.errors import GpuwardenError

log = logging.getLogger(__name__)

# What a tier's listing or a copy's loading and decoding may raise on bad data or a bad tier
# (RecursionError: a manifest nested too deeply for some parser; MemoryError: a copy too large
# for this node, when an older one may fit). A bug elsewhere (TypeError...) still surfaces.
COPY_ERRORS = (GpuwardenError, OSError, ValueError, RecursionError, MemoryError)
# Why copies were skipped, as `Restored.skipped` and the log line say it: the first this many
# and a count (a tier holding many bad names must not make one line grow with them).
MAX_SKIPPED = 32


class TiersUnavailable(TierError):
    """Nothing restored while some tier could not even be listed."""


@dataclass(frozen=True)
class Restored:
    step: int  # always manifest.step
    tier: str
    state: dict[str, Any]
    manifest: Manifest
    skipped: tuple[str, ...]  # why newer or faster copies were not used


def listed(tiers: Sequence[Tier]) -> tuple[dict[str, set[int]], list[str]]:
    """Each tier's steps, and why the tiers left out could not be listed."""
    held: dict[str, set[int]] = {}
    failed: list[str] = []
    for t in tiers:
        try:
            held[t.name] = set(t.steps())
        except COPY_ERRORS as exc:
            log.warning("cannot list %s (%s); using the other tiers", t.name, exc)
            failed.append(f"{t.name}: {exc}")
    return held, failed


def copy_of(t: Tier, step: int, mapped: bool = False) -> tuple[Manifest, dict[str, Any]]:
    """Exactly ``step`` from one tier, verified and decoded; COPY_ERRORS when it is not
    there or not good."""
    manifest, data = t.load(step, mapped=True) if mapped and isinstance(t, FsTier) else \
        t.load(step)
    if manifest.step != step:  # every tier checks this; a tier that does not is not trusted
        raise TierError(f"{t.name} step {step}: its manifest is of step {manifest.step}")
    state = {s.name: decode(s, data[s.name]) for s in manifest.shards}
    # A nested state (torch state_dicts ...) is rebuilt here, so a tree that does not fit its
    # shards is a bad copy like any other; a missing torch is not, and is raised as it is.
    return manifest, nested.unflatten(state) if nested.is_nested(state) else state


def restore(tiers: Sequence[Tier], at_most: int | None = None,
            refused: set[tuple[str, int]] | None = None, mapped: bool = False) -> Restored | None:
    """See the module's contract. ``refused`` collects (tier, step) of every copy that could
    not be used, so that a cleanup after this restore leaves them in place. ``mapped``: arrays
    from node memory map its pages copy-on-write instead of copying them (see
    `JobCheckpointer.restore`)."""
    held, failed = listed(tiers)
    skipped = [f"not listed: {why}" for why in failed]
    steps = sorted({s for h in held.values() for s in h if at_most is None or s <= at_most},
                   reverse=True)
    for step in steps:
        for t in tiers:
            if step not in held.get(t.name, ()):
                continue
            try:
                manifest, state = copy_of(t, step, mapped)
            except COPY_ERRORS as exc:
                why = str(exc) if isinstance(exc, GpuwardenError) else \
                    f"{t.name} step {step}: {type(exc).__name__}: {str(exc)[:200]}"
                log.warning("%s; trying the next copy", why[:1000])
                _note(skipped, why)
                if refused is not None:
                    refused.add((t.name, step))
                continue
            if skipped:
                log.warning("restored step %d from %s after skipping: %s", step, t.name,
                            "; ".join(_shown(skipped)))
            return Restored(step, t.name, state, manifest, tuple(_shown(skipped)))
        _note(skipped, f"step {step}: no tier holds a verified copy; walking back")
        log.warning("step %d: no tier holds a verified copy; walking back to an older step",
                    step)
    if failed:
        raise TiersUnavailable("nothing restored, and some tiers could not be listed (they may "
                               "hold the step; not starting fresh): " + "; ".join(failed))
    return None


def _note(skipped: list[str], why: str) -> None:
    """Kept: the first `MAX_SKIPPED` reasons, each cut short; only counted after that."""
    skipped.append(why[:1000] if len(skipped) < MAX_SKIPPED else "")


def _shown(skipped: list[str]) -> list[str]:
    more = len(skipped) - MAX_SKIPPED
    return skipped if more <= 0 else [*skipped[:MAX_SKIPPED], f"and {more} more"]
