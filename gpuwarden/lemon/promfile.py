"""`gpuwarden lemon scan`'s series (`gpuwarden_lemon.prom`, in the admin host's `[health]
prom_dir`): when a scan last ended cleanly, the lemons it found and how many of their drains
the blast-radius cap held, the lemon drains made (counted in `[health] state_dir`,
`lemon-metrics.json`, across scans: gpuwarden.core.counterfile), and the fleet's MTTF by job
size over the scan's history (gpuwarden.accounting.mttf's size classes, by GPUs)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from gpuwarden.core import counterfile, metrics
from gpuwarden.core.metrics import Metric, Sample
from gpuwarden.core.safefs import read_plain

FILE = "gpuwarden_lemon.prom"
COUNTS = "lemon-metrics.json"
DRAINS = "drains"


def samples(last_success: float, flagged: int, held: int, drains: float,
            mttf_h: Mapping[int, float]) -> dict[Metric, list[Sample]]:
    return {
        metrics.LEMON_LAST_SUCCESS: [((), last_success)],
        metrics.LEMON_FLAGGED: [((), float(flagged))],
        metrics.LEMON_HELD: [((), float(held))],
        metrics.LEMON_DRAINS: [((), drains)],
        metrics.FLEET_MTTF: [((str(g),), h) for g, h in sorted(mttf_h.items())],
    }


def publish(prom_dir: str, state_dir: str, now: float, clean: bool, flagged: int,
            actions: Sequence[str], mttf_h: Mapping[int, float]) -> str:
    """Count the drains among ``actions`` (what --drain did to each lemon) and write the
    textfile; ``clean``: the scan ended without a failed drain (else the last clean scan's
    time stays). Returns why the counts were reset ("" when they were not). Raises OSError or
    a GpuwardenError (then the textfile is as it was)."""
    def write(counts: counterfile.Numbers) -> None:
        # Under the counts' lock: a scan beside this one never writes an older count last.
        last = now if clean else (metrics.value_of(read_plain(os.path.join(prom_dir, FILE)),
                                                   metrics.LEMON_LAST_SUCCESS) or 0.0)
        metrics.write(prom_dir, FILE, samples(last, flagged, sum(a == "held" for a in actions),
                                              counts.get(DRAINS, 0.0), mttf_h))

    _, reset = counterfile.update(state_dir, COUNTS,
                                  {DRAINS: float(sum(a == "drained" for a in actions))},
                                  then=write)
    return reset
