"""Checkpointing's node series (`gpuwarden_ckpt.prom`): what tier 0 holds (`nodescan`, read by
the periodic check) and what root's prolog did for jobs' checkpoints (squatters moved aside,
stage-ins), counted in the state directory (`ckpt-metrics.json`, gpuwarden.core.counterfile)
so the counts survive runs and reboots and never go backwards. The prolog only counts; the
periodic check writes the file (a counter shows at most one check interval late).

The last requeued job's stage-in is also kept whole in the state directory
(``ckpt-stagein.json``: its outcome, its line, everything its child said), for whoever looks at
the node (`cat`, the e2e tests): the counter says how often, the record says why."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpuwarden.core import counterfile, metrics
from gpuwarden.core.metrics import Metric, Sample
from gpuwarden.core.safefs import atomic_write, ensure_private_dir, read_private

if TYPE_CHECKING:
    # Imported where a scan runs: the prolog only counts and must not load it.
    from gpuwarden.ckpt.nodescan import Held

FILE = "gpuwarden_ckpt.prom"
COUNTS = "ckpt-metrics.json"
SQUATTERS = "squatters"
_STAGEIN = "stageins."  # + the outcome
SCAN_S = 5.0  # the scan runs in a child killed after this (the shared filesystem may hang)
LAST_STAGEIN = "ckpt-stagein.json"


def count(state_dir: str, squatters: int = 0, stagein: str = "", wait_s: float = 1.0) -> None:
    """Add what one prolog did. Raises OSError or StateDirError (then nothing changed) and
    ValueError for an outcome that is not one of STAGEIN_OUTCOMES."""
    add: dict[str, float] = {}
    if squatters:
        add[SQUATTERS] = float(squatters)
    if stagein:
        if stagein not in metrics.STAGEIN_OUTCOMES:
            raise ValueError(f"stage-in outcome {stagein!r}")
        add[_STAGEIN + stagein] = 1.0
    if add:
        counterfile.update(state_dir, COUNTS, add, {}, wait_s=wait_s)


def note_stagein(state_dir: str, record: Mapping[str, object]) -> None:
    """Keep ``record`` (`stagein.Outcome.record`: JSON-able, about 10 KiB at most) as the
    last stage-in, root's alone, replaced atomically. Raises OSError or StateDirError."""
    ensure_private_dir(state_dir)
    atomic_write(state_dir, LAST_STAGEIN, json.dumps(record).encode(), 0o600)


def last_stagein(state_dir: str) -> dict[str, Any] | None:
    """The last stage-in's record, or None when there is none (or it is not a JSON object).
    Raises StateDirError when the file or its directory is not root's alone."""
    data = read_private(os.path.join(state_dir, LAST_STAGEIN))
    try:
        doc = json.loads(data) if data else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def samples(node: str, held: Held | None, counts: dict[str, float]
            ) -> dict[Metric, list[Sample]]:
    """The file's samples; without ``held`` (the scan failed) only the counters and the
    scan's failure."""
    out: dict[Metric, list[Sample]] = {
        metrics.SQUATTERS: [((node,), counts.get(SQUATTERS, 0.0))],
        metrics.STAGEINS: [((node, o), counts.get(_STAGEIN + o, 0.0))
                           for o in metrics.STAGEIN_OUTCOMES],
        metrics.SCAN_COMPLETE: [((node,), 1.0 if held is not None and held.complete else 0.0)],
    }
    if held is not None:
        out[metrics.TIER0_BYTES] = [((node,), float(held.bytes))]
        out[metrics.TIER0_STEPS] = [((node,), float(held.steps))]
        out[metrics.LAST_SAVE] = [((node,), held.newest_save)]
        out[metrics.TIER0_SKIPPED] = [((node,), float(held.skipped))]
        out[metrics.DURABLE_LAG] = [((node, b), lag) for b, lag in sorted(held.lag.items())]
    return out


def scan_in_child(memory_root: str, shared_root: str, state_dir: str, deadline_s: float
                  ) -> Held:
    """`nodescan.scan` in a child killed at ``deadline_s`` (ChildTimeout): a hung shared
    filesystem never holds up the periodic check. The scan itself stops short of it (its own
    bound on time) and says it did. Raises GpuwardenError or OSError."""
    from gpuwarden.ckpt import childcall, nodescan  # noqa: PLC0415 - see TYPE_CHECKING

    time_s = max(0.1, min(nodescan.TIME_S, deadline_s - 1.0))
    doc = childcall.call(
        lambda: nodescan.scan(memory_root, shared_root, state_dir, time_s=time_s).as_dict(),
        deadline_s)
    if not isinstance(doc, dict):
        raise childcall.ChildFailed(f"tier-0 scan: {type(doc).__name__} from the child")
    return nodescan.Held.from_dict(doc)


def write(state_dir: str, prom_dir: str, node: str, held: Held | None,
          wait_s: float = 1.0) -> str:
    """The textfile from the stored counts and ``held``, under the counts' lock; why the
    counts were reset ("" when they were not). Raises OSError or a GpuwardenError."""
    with counterfile.locked(state_dir, COUNTS, wait_s) as (counts, reset):
        metrics.write(prom_dir, FILE, samples(node, held, counts))
    return reset
