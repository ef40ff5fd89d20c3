"""The drain reason health gating writes, and how it recognises its own drain from it alone.

The stored counters can be lost (a kill between the drain and their save, a full disk), so the
reason itself carries a tag: a node resumes a drain whose Slurm reason ends with it (before
anything slurmctld appended), and only
health gating writes it (`gpuwarden drain` refuses it, the lemon scanner never uses it).
"""

from __future__ import annotations

from gpuwarden.slurm.models import REASON_PREFIX, own_part

HEALTH_TAG = "[health]"
# gpuwarden.slurm.client.gpuwarden_reason cuts reasons at 200 characters: the tag must survive.
_MAX_REASON = 200


def health_reason(evidence: str) -> str:
    """The reason text (without the `gpuwarden:` prefix the client adds) for a health drain."""
    body = " ".join(evidence.split()) or "health check failed"
    if body.startswith(REASON_PREFIX):
        body = body[len(REASON_PREFIX):].lstrip()
    room = _MAX_REASON - len(REASON_PREFIX) - 2 - len(HEALTH_TAG)
    if len(body) > room:
        body = body[: room - 3] + "..."
    return f"{body} {HEALTH_TAG}"


def is_health_drain(reason: str) -> bool:
    """True for a Slurm reason written by health gating (see health_reason), also once
    slurmctld has appended its own " : <msg>" to it (a node not responding, a reboot)."""
    return reason.startswith(REASON_PREFIX) and own_part(reason).endswith(f" {HEALTH_TAG}")


def health_drain_reason(reason: str) -> str:
    """The reason health gating wrote, without Slurm's additions ("" when not its drain)."""
    return own_part(reason) if is_health_drain(reason) else ""


def names_the_tag(text: str) -> bool:
    """True when a reason given by hand would pass for health gating's own."""
    return HEALTH_TAG in text
