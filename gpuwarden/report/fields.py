"""Fields of a streamed record that `AcctRecord` does not name (partition, submit time), read
from either record type the stream yields: an AcctJob, or the fast decoder's lazy Run."""

from __future__ import annotations

from typing import Any

from gpuwarden.accounting.stream import AcctRecord
from gpuwarden.slurm.models import AcctJob


def partition(r: AcctRecord) -> str:
    if isinstance(r, AcctJob):
        return r.partition
    value: Any = getattr(r, "partition_", None)  # acctfast.Run keeps it raw
    return value if isinstance(value, str) else ""


def _number(v: Any) -> int | None:
    """An int, or Slurm's {"set", "infinite", "number"} wrapper as acctfast decodes it."""
    if isinstance(v, int):
        return v
    if v is None or not getattr(v, "set", True) or getattr(v, "infinite", False):
        return None
    n = getattr(v, "number", None)
    return n if isinstance(n, int) else None


def submitted(r: AcctRecord) -> int | None:
    if isinstance(r, AcctJob):
        return r.submit_time or None
    return _number(getattr(getattr(r, "time", None), "submission", None)) or None
