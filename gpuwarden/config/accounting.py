"""Accounting-store settings (the `[accounting]` table)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuwarden.core.configload import require


@dataclass(frozen=True)
class AccountingConfig:
    # The accounting store (`gpuwarden accounting ingest/sync`, docs/report.md): where set,
    # `lemon scan`, `fleet mttf` and `report` read it instead of slurmdbd unless told --from,
    # --store or --live. "" for none.
    store: str = ""
    # `accounting sync`: how far back a store's first sync reads.
    sync_since: str = "30d"
    # `accounting sync` reads up to this long before now: slurmctld hands a finished run to
    # slurmdbd through its agent queue, and a run recorded after its window was synced would
    # be missed for good.
    sync_settle_s: int = 900

    def __post_init__(self) -> None:
        require(self.store == "" or (bool(re.fullmatch(r"(/[A-Za-z0-9._@+-]+)+", self.store))
                                     and ".." not in self.store.split("/")), "store",
                "an absolute directory path without '..', or \"\" for none")
        require(bool(re.fullmatch(r"\d+[mhdw]", self.sync_since)), "sync_since",
                "a span like 30d, 12h or 2w")
        require(isinstance(self.sync_settle_s, int) and not isinstance(self.sync_settle_s, bool)
                and 0 <= self.sync_settle_s <= 7 * 86_400, "sync_settle_s",
                "whole seconds from 0 to 604800 (a week)")
