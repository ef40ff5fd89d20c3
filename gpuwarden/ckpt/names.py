"""Names that become path components (job namespaces, shard names): validated, never trusted."""

from __future__ import annotations

import re

from gpuwarden.core.errors import GpuwardenError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
MAX_STEP = 10**12
# A job's replicas in other ranks' memory live in the namespace "<job>.peer" (docs/checkpointing.md).
PEER_SUFFIX = ".peer"


class BadName(GpuwardenError):
    """A name that could leave its directory, or a step that is not a step."""


def _shown(value: object) -> str:
    """A value from a user's file, as one short line (it may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def check_name(name: str, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise BadName(f"{what} {_shown(name)}: use 1-128 letters, digits, '_', '-', '.', not starting "
                      "with '.' or '-' and without '..'")
    return name


def job_of(namespace: str) -> str:
    """The job whose checkpoints a namespace directory holds: ``job-7`` and ``job-7.peer`` are
    both job-7's (a manifest names the job, not the namespace it was copied into)."""
    return namespace.removesuffix(PEER_SUFFIX)


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        raise BadName(f"step {_shown(step)}: expected an integer from 0 to {MAX_STEP - 1}")
    return step


def step_dir(step: int) -> str:
    return f"step-{check_step(step):012d}"


def parse_step_dir(name: str) -> int | None:
    m = re.fullmatch(r"step-([0-9]{12})", name)
    return int(m.group(1)) if m else None
