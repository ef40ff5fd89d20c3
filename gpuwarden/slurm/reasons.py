"""The drain reason health gating writes, and how it recognises its own drain from it alone.

The stored counters can be lost (a kill between the drain and their save, a full disk), so the
reason itself carries a tag: a node resumes a drain whose Slurm reason ends with it (before
anything slurmctld appended), and only
health gating writes it (`gpuwarden drain` refuses it, the lemon scanner never uses it).
"""

from __future__ import annotations

import re

from gpuwarden.slurm.models import REASON_PREFIX, own_part

HEALTH_TAG = "[health]"
# gpuwarden.slurm.client.gpuwarden_reason cuts reasons at 200 characters: the tag must survive.
_MAX_REASON = 200
# Which run of health gating drained the node, first in the reason: the report tells the jobs
# the prolog kept off a bad node from the failures only the epilog caught by it. Only root's
# health gating writes a drain reason, and it writes this word before any evidence (which may
# quote kernel text a user shaped), so the word is gating's own.
ORIGINS = ("prolog", "epilog", "periodic")
_CONTEXTS = {"prolog": "prolog", "epilog": "epilog", "health": "periodic"}


def origin_of(context: str) -> str:
    """The origin word for a verdict's context ("prolog job 12", "health check", ...); ""
    for a context that is none of health gating's runs."""
    return _CONTEXTS.get(context.split(" ", 1)[0], "")


def health_reason(evidence: str, origin: str = "") -> str:
    """The reason text (without the `gpuwarden:` prefix the client adds) for a health drain,
    ``origin`` (one of ORIGINS, or "") first."""
    if origin and origin not in ORIGINS:
        raise ValueError(f"origin {origin!r}: expected one of {', '.join(ORIGINS)}")
    body = " ".join(evidence.split()) or "health check failed"
    if body.startswith(REASON_PREFIX):
        body = body[len(REASON_PREFIX):].lstrip()
    head = f"{origin}: " if origin else ""
    room = _MAX_REASON - len(REASON_PREFIX) - 2 - len(HEALTH_TAG) - len(head)
    if len(body) > room:
        body = body[: room - 3] + "..."
    return f"{head}{body} {HEALTH_TAG}"


def drain_origin(reason: str) -> str:
    """Which run of health gating wrote this health drain's reason (one of ORIGINS); "" when
    it is not a health drain or names none (a drain made before reasons carried it)."""
    if not is_health_drain(reason):
        return ""
    word, sep, _ = reason[len(REASON_PREFIX):].lstrip().partition(": ")
    return word if sep and word in ORIGINS else ""


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


# The lemon scanner's drain reason (gpuwarden.lemon.scoring.NodeScore.summary, a test holds
# them together): "lemon, 3 of 40 jobs failed, fleet rate 1.2%".
_LEMON = re.compile(r"lemon, \d{1,12} of \d{1,12} jobs failed\b")
OWNERS = ("health", "lemon")


def is_lemon_drain(reason: str) -> bool:
    """True for a Slurm reason the lemon scanner wrote (`gpuwarden lemon scan --drain`)."""
    if not reason.startswith(REASON_PREFIX) or is_health_drain(reason):
        return False
    return bool(_LEMON.match(own_part(reason)[len(REASON_PREFIX):].lstrip()))


def drain_owner(reason: str) -> str:
    """Which part of gpuwarden drained a node with this reason: "health" (health gating),
    "lemon" (the lemon scanner), or "" (anyone else: an operator, Slurm, `gpuwarden drain` by
    hand)."""
    if is_health_drain(reason):
        return "health"
    return "lemon" if is_lemon_drain(reason) else ""
