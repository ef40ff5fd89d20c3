"""Where the filter looks for its snapshot, for `gpuwarden config check`. Pure.

job_submit.lua reads the snapshot only from the directory of the job_submit.lua slurmctld
loaded (slurm.conf's), so a `snapshot_file` anywhere else means placement is silently off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"


def problem(snapshot_file: str, environ: Mapping[str, str] | None = None) -> str:
    """Why the filter would never read ``snapshot_file``; "" when it would, or when slurm.conf's
    directory holds no job_submit.lua (placement is not installed there)."""
    env = os.environ if environ is None else environ
    conf_dir = os.path.dirname(env.get("SLURM_CONF") or DEFAULT_SLURM_CONF)
    filter_file = os.path.join(conf_dir, "job_submit.lua")
    if not os.path.exists(filter_file):
        return ""
    if os.path.dirname(snapshot_file) != conf_dir:
        return (f"placement.snapshot_file {snapshot_file} is not beside {filter_file}: job_submit.lua "
                f"reads its snapshot only from {conf_dir}, so placement would be off")
    return ""
