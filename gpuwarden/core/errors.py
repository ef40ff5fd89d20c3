"""The project's own exceptions; vendor errors are translated into these where they enter."""

from __future__ import annotations


class GpuwardenError(Exception):
    """Base of every error gpuwarden raises on purpose."""


class ConfigError(GpuwardenError):
    """A configuration file is unreadable or invalid; nothing may be acted on."""

    def __init__(self, path: str, key: str, expected: str) -> None:
        self.path = path
        self.key = key
        self.expected = expected
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {expected}")


class SlurmError(GpuwardenError):
    """A Slurm command failed or printed something we could not understand."""


class SlurmUnavailableError(SlurmError):
    """The controller did not answer, even after retries."""


class SlurmParseError(SlurmError):
    """Slurm's output did not have the shape we expect."""


class NotOurDrainError(SlurmError):
    """Refused: the node's drain/down reason was not set by gpuwarden."""


class InstallError(GpuwardenError):
    """Refused: installing would be unsafe or would change what the site chose.

    Here, not in gpuwarden.install, because safefs's walk to a directory root writes in
    (`opened_dir`, also `health inject`'s) raises it."""
