"""A batch of accounting records as columns: each field read once per record, however many
tallies read it (the lemon attribution and the report's tally both read nodes, state, start,
end and GPUs of every record).

At fleet scale (10 million records) reading a field through the record's property, two or
three times per record, cost more than decoding the record. Columns are built on first use,
from the fast decoder's structs without a property call where the value is plain
(`acctfast.nodes_of` and the rest); a time or count that is unset is 0, as the property's
None. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from gpuwarden.accounting import fastdecode as acctfast
from gpuwarden.accounting.stream import AcctRecord
from gpuwarden.slurm.hostranges import shape

_COLUMNS = ("nodes", "states", "starts", "ends", "gpus", "restarts", "job_ids", "partitions",
            "shaped", "users", "submits")


class Columns:
    """``records`` and their fields by column, in the same order."""

    def __init__(self, records: Sequence[AcctRecord]) -> None:
        self.records: list[AcctRecord] = list(records)

    def __len__(self) -> int:
        return len(self.records)

    @cached_property
    def nodes(self) -> list[str]:
        return acctfast.nodes_of(self.records)

    @cached_property
    def states(self) -> list[str]:
        return acctfast.states_of(self.records)

    @cached_property
    def starts(self) -> list[int]:
        """Start times; 0 where the record has none."""
        return acctfast.starts_of(self.records)

    @cached_property
    def ends(self) -> list[int]:
        """End times; 0 where the record has none."""
        return acctfast.ends_of(self.records)

    @cached_property
    def gpus(self) -> list[int]:
        return acctfast.gpus_of(self.records)

    @cached_property
    def restarts(self) -> list[int]:
        """Restart counts; 0 where accounting does not say."""
        return acctfast.restarts_of(self.records)

    @cached_property
    def job_ids(self) -> list[int]:
        return [r.job_id for r in self.records]

    @cached_property
    def users(self) -> list[str]:
        return [r.user for r in self.records]

    @cached_property
    def submits(self) -> list[str]:
        """`submit_line`s ("" where accounting has none)."""
        return [r.submit_line for r in self.records]

    @cached_property
    def partitions(self) -> list[str]:
        return acctfast.partitions_of(self.records)

    @cached_property
    def shaped(self) -> list[bool]:
        """Whether `hostranges.shape` reads the node list (one name, or one bracket)."""
        memo: dict[str, bool] = {}
        out = []
        for text in self.nodes:
            ok = memo.get(text)
            if ok is None:
                ok = memo[text] = bool(text) and shape(text) is not None
            out.append(ok)
        return out

    def ended_in(self, lo: float, hi: float) -> Columns:
        """The records that ended in [lo, hi) (a record without an end did not end)."""
        keep = [i for i, e in enumerate(self.ends) if e and lo <= e < hi]
        if len(keep) == len(self.records):
            return self
        out = Columns([self.records[i] for i in keep])
        for name in _COLUMNS:
            col = self.__dict__.get(name)  # only what was read already
            if col is not None:
                out.__dict__[name] = [col[i] for i in keep]
        return out


def columns(records: Sequence[AcctRecord] | Columns) -> Columns:
    return records if isinstance(records, Columns) else Columns(records)
