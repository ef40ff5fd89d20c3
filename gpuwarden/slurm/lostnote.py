"""The launcher's note of lost nodes in a job's Comment: written by `gpuwarden launch` (as the
job's user), read back by health gating's epilog (as root) to decide which nodes get every
check after the job. One format, so writer and reader cannot drift apart.

``gpuwarden-launch: lost c3 (rank 1: no heartbeat for 6.0 s [deadline 5 s]); c7 (rank 0)``

The owner of a job may set its Comment to anything: what is read back is a hint to look
harder at a node of that job, never evidence by itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

PREFIX = "gpuwarden-launch: lost "
# Comments the launcher may replace: its own, and placement's note on a waiting job. Any other
# is the user's (sbatch --comment) and is kept.
OURS = ("gpuwarden-launch:", "gpuwarden: this job may wait")
MAX_LEN = 1000  # every lost node must fit (the epilog checks only those named)
_WHY_LEN = 100
_CUT = "...; "

# An entry: a Slurm node name, its rank, and what the launcher saw, without ( ) ; in it, so
# entries cannot run into each other.
_ENTRY = (r"([A-Za-z0-9][A-Za-z0-9._-]{0,63}) \(rank ([0-9]{1,7})(?:: ([^();]{0,"
          + str(_WHY_LEN) + r"}))?\)")
_ENTRY_RE = re.compile(_ENTRY, re.ASCII)
_NOTE_RE = re.compile(f"(?:{re.escape(_CUT)})?{_ENTRY}(?:; {_ENTRY})*", re.ASCII)


def _clean(why: str) -> str:
    text = why.replace("(", "[").replace(")", "]").replace(";", ",")
    return "".join(c if c.isprintable() else "?" for c in text)[:_WHY_LEN].strip()


def format_lost(entries: Sequence[tuple[str, int, str]]) -> str:
    """The note for (node, rank, why) entries, oldest first. Too long, the older entries lose
    their why first (every node stays named); only past that are the oldest dropped. Pure."""
    parts = [(node, rank, _clean(why)) for node, rank, why in entries]

    def text(keep_why_from: int, first: int) -> str:
        shown = [f"{n} (rank {r}: {w})" if w and i >= keep_why_from else f"{n} (rank {r})"
                 for i, (n, r, w) in enumerate(parts) if i >= first]
        return PREFIX + (_CUT if first else "") + "; ".join(shown)

    for keep in range(len(parts) + 1):
        if len(out := text(keep, 0)) <= MAX_LEN:
            return out
    first = 0
    while len(out := text(len(parts), first)) > MAX_LEN and first < len(parts) - 1:
        first += 1
    return out


def replaceable(current: str | None) -> bool:
    """True when a job's Comment is empty or one gpuwarden wrote: it may be replaced."""
    return current is None or current.strip() in ("", "(null)") or current.startswith(OURS)


def lost_in(comment: str | None) -> dict[str, str]:
    """The nodes a launcher's note names as lost, each with what the launcher saw ("rank 1:
    no heartbeat ..."); {} for anything that is not exactly such a note. Pure; never raises."""
    if not comment or not comment.startswith(PREFIX) or len(comment) > 2 * MAX_LEN:
        return {}
    body = comment[len(PREFIX):]
    if not _NOTE_RE.fullmatch(body):
        return {}
    found: dict[str, str] = {}
    for m in _ENTRY_RE.finditer(body):
        # The job's owner may have written it: only printable text reaches root's logs.
        why = _clean(m.group(3) or "")
        found.setdefault(m.group(1), f"rank {m.group(2)}" + (f": {why}" if why else ""))
    return found
