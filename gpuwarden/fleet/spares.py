"""Whether k hot-spare nodes per job pay for themselves at the site's own failure rate. Pure;
`gpuwarden fleet mttf` and the fleet report's ETTR section both ask it.

Per job size: the GPU-hours the spares hold idle, H x k x GPUs per node (H the size's
job-hours), against the GPU-hours requeues lose that a spare would not, F x (u0 - s) x the
size's mean GPUs (F its infrastructure failures; u0 a requeue's wait and restore, s a spare's
take-over; the work since the last checkpoint is lost either way). They pay when the second
is larger. A one-node size gets none: a spare node cannot stand in for part of a node.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Payoff:
    idle_gpu_h: float  # what k spares per job hold idle
    requeue_lost_gpu_h: float  # what requeues lose that a spare would not

    @property
    def pays(self) -> bool:
        return self.requeue_lost_gpu_h > self.idle_gpu_h


def payoff(nodes: int, job_hours: float, failures: int, mean_gpus: float, spares: int,
           gpus_per_node: int, restart_h: float, swap_h: float) -> Payoff | None:
    """None for a one-node size (``nodes`` <= 1)."""
    if nodes <= 1:
        return None
    return Payoff(job_hours * spares * gpus_per_node,
                  failures * max(0.0, restart_h - swap_h) * mean_gpus)
