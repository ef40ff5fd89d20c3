"""The launcher's timings and limits (CLI options of `gpuwarden launch`)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.core.configload import FieldError, require

# What the sbatch template requeues on (gpuwarden.ckpt.job.EXIT_REQUEUE; not imported: that
# module needs numpy, and the launcher on the batch host should start without it).
EXIT_REQUEUE = 75


@dataclass(frozen=True)
class LaunchSettings:
    spares: int = 1
    beat_s: float = 1.0  # each rank sends one heartbeat this often
    deadline_s: float = 10.0  # a rank silent this long has lost its node
    start_s: float = 120.0  # from a step's start to a rank's first beat (imports, meeting)
    hang_s: float = 300.0  # no training progress this long, every rank alive: hung; 0: off
    stop_s: float = 30.0  # how long ending a step may take before srun is killed
    hang_relaunches: int = 1  # relaunches on the same nodes after a hang; then requeue

    def __post_init__(self) -> None:
        require(0 <= self.spares <= 64, "spares", "0 to 64")
        require(0 < self.beat_s <= 60, "beat_s", "seconds, above 0 and at most 60")
        # One lost datagram must never count as a lost node.
        require(self.deadline_s >= 3 * self.beat_s, "deadline_s", "at least 3 x beat_s")
        require(self.start_s >= self.deadline_s, "start_s", "at least deadline_s")
        require(self.hang_s == 0 or self.hang_s >= self.deadline_s, "hang_s",
                "0 (off) or at least deadline_s")
        require(self.stop_s > 0, "stop_s", "seconds > 0")
        require(0 <= self.hang_relaunches <= 10, "hang_relaunches", "0 to 10")

    @property
    def poll_s(self) -> float:
        """How often the launcher looks: well inside a beat, so detection adds little."""
        return min(self.beat_s / 2, 0.5)


def settings(**values: float | int) -> LaunchSettings:
    """LaunchSettings, or ValueError naming the option."""
    try:
        return LaunchSettings(**values)  # type: ignore[arg-type]
    except FieldError as exc:
        raise ValueError(f"--{exc.key.replace('_', '-')}: {exc.expected}") from None
