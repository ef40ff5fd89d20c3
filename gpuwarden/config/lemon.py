"""Lemon-detector settings (the `[lemon]` table)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuwarden.core.configload import require


@dataclass(frozen=True)
class LemonConfig:
    fdr: float = 0.01  # false discovery rate across the fleet
    min_failures: int = 3  # no verdict on less evidence than this
    min_jobs: int = 10
    min_ratio: float = 3.0  # a lemon fails at least this many times what the fleet predicts
    grace_s: float = 3600.0  # how long after a run a health drain still explains its failure
    # The current lemons, published for placement (written by `lemon scan --drain/--write-list`).
    # Its own directory: health gating's state directory is root-only.
    list_file: str = "/var/lib/gpuwarden-lemons/lemons.json"

    def __post_init__(self) -> None:
        require(0 < self.fdr < 1, "fdr", "a probability between 0 and 1")
        require(self.min_failures >= 1, "min_failures", "an integer >= 1")
        require(self.min_jobs >= 1, "min_jobs", "an integer >= 1")
        require(self.min_ratio >= 1, "min_ratio", "a number >= 1")
        require(self.grace_s >= 0, "grace_s", "seconds >= 0")
        require(bool(re.fullmatch(r"(/[A-Za-z0-9._@+-]+)+", self.list_file))
                and ".." not in self.list_file.split("/"), "list_file",
                "an absolute file path without '..'")
