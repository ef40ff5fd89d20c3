"""How gpuwarden talks to Slurm: the `[slurm]` section of the config file."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.core.configload import require


@dataclass(frozen=True)
class SlurmConfig:
    """How gpuwarden talks to Slurm."""

    backend: str = "cli"
    bin_dir: str = ""
    command_timeout_s: float = 30.0
    retries: int = 3
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0

    def __post_init__(self) -> None:
        # pyslurm needs its major version to equal Slurm's; see docs/admin-guide.md.
        require(self.backend == "cli", "backend", 'must be "cli" (the only backend shipped)')
        require(
            self.bin_dir == "" or self.bin_dir.startswith("/"),
            "bin_dir",
            "an absolute directory, or empty to find Slurm's commands without PATH",
        )
        require(0 < self.command_timeout_s <= 600, "command_timeout_s", "a number in (0, 600]")
        require(0 <= self.retries <= 10, "retries", "an integer from 0 to 10")
        require(0 <= self.backoff_initial_s <= 60, "backoff_initial_s", "a number in [0, 60]")
        require(
            self.backoff_initial_s <= self.backoff_max_s <= 300,
            "backoff_max_s",
            "a number from backoff_initial_s to 300",
        )
