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

    def __post_init__(self) -> None:
        require(self.store == "" or (bool(re.fullmatch(r"(/[A-Za-z0-9._@+-]+)+", self.store))
                                     and ".." not in self.store.split("/")), "store",
                "an absolute directory path without '..', or \"\" for none")
        require(bool(re.fullmatch(r"\d+[mhdw]", self.sync_since)), "sync_since",
                "a span like 30d, 12h or 2w")
