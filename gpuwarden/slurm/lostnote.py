"""The launcher's note of lost nodes in a job's Comment: written by `gpuwarden launch` (as the
job's user), read back by health gating's epilog (as root) to decide which nodes get every
check after the job. One format, so writer and reader cannot drift apart.

``gpuwarden-launch: lost c3 (rank 1: no heartbeat for 6.0 s); c7 (rank 0: ...)``

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
MAX_LEN = 250  # scontrol keeps more; short enough to read in `squeue -o %k`

# One entry: a node name (Slurm's characters), then "(rank N: why)".
_ENTRY = re.compile(r"(?:^|; )([A-Za-z0-9][A-Za-z0-9._-]{0,63}) \(rank (\d{1,7}): ([^)]*)\)?")


def format_lost(entries: Sequence[tuple[str, int, str]]) -> str:
    """The note for (node, rank, why) entries, oldest first, cut to MAX_LEN; the newest losses
    are the ones kept when cut. Pure."""
    parts = [f"{node} (rank {rank}: {why})" for node, rank, why in entries]
    text = PREFIX + "; ".join(parts)
    while len(text) > MAX_LEN and len(parts) > 1:
        parts = parts[1:]
        text = PREFIX + "...; " + "; ".join(parts)
    return text[:MAX_LEN]


def replaceable(current: str | None) -> bool:
    """True when a job's Comment is empty or one gpuwarden wrote: it may be replaced."""
    return current is None or current.strip() in ("", "(null)") or current.startswith(OURS)


def lost_in(comment: str | None) -> dict[str, str]:
    """The nodes a launcher's note names as lost, each with what the launcher saw ("rank 1:
    no heartbeat ..."); {} for any other comment. Pure; never raises."""
    if not comment or not comment.startswith(PREFIX):
        return {}
    body = comment[len(PREFIX):]
    if body.startswith("...; "):
        body = body[len("..."):]
    found: dict[str, str] = {}
    for m in _ENTRY.finditer(body):
        # The job's owner wrote it: only printable text goes into root's logs and verdicts.
        why = "".join(c if c.isprintable() else "?" for c in m.group(3)[:100])
        found.setdefault(m.group(1), f"rank {m.group(2)}: {why}")
    return found
