"""Tiered checkpointing for training jobs under Slurm.

A rank saves into node memory and returns; a background writer copies each step to a partner
node's memory (peers), the shared filesystem and S3, in that order. On a restart the ranks agree
on the newest step every one of them holds and read it from the fastest tier holding a verified
copy, walking back past damaged ones; a requeued job's prolog stages that step into the new
nodes' memory first. Every step is a manifest written last over checksummed shards
(docs/checkpointing.md).

The public API is ``__all__`` below: what a training script and an adapter of its own use.

    from gpuwarden.ckpt import EXIT_REQUEUE, JobCheckpointer

    ck = JobCheckpointer.from_slurm()
    got = ck.restore()
    ...

Two adapter modules are public as well, each with its own ``__all__``:
`gpuwarden.ckpt.nested` (PyTorch ``state_dict``s and other nested state, flattened into
shards and built back) and `gpuwarden.ckpt.dcp` (a `torch.distributed.checkpoint` storage
writer and reader). Every other module here is internal and may change.

``import gpuwarden.ckpt`` imports nothing: the node-side hooks import parts of this package and
numpy, xxhash, torch and boto3 are optional, so each name is imported from its module when it
is first used (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuwarden.ckpt.checkpointer import PendingSave
    from gpuwarden.ckpt.codec import Buf, StateError, checksum
    from gpuwarden.ckpt.coord import CoordError
    from gpuwarden.ckpt.job import EXIT_REQUEUE, JobCheckpointer, JobEnv, JobEnvError
    from gpuwarden.ckpt.manifest import Manifest
    from gpuwarden.ckpt.names import BadName
    from gpuwarden.ckpt.nested import Later
    from gpuwarden.ckpt.restore import Restored, TiersUnavailable
    from gpuwarden.ckpt.tier import CorruptStep, Tier, TierError, TierFull
    from gpuwarden.slurm.hostlist import expand as expand_hostlist

# Each public name and the module that defines it (the imports above, for type checkers); a
# name from outside this package is "module:attribute".
_HOME = {
    # The job's runtime: one per rank.
    "EXIT_REQUEUE": "job",
    "JobCheckpointer": "job",
    "JobEnv": "job",
    "JobEnvError": "job",
    # What save, begin and restore return, and what an adapter gives `JobCheckpointer.begin`.
    "Later": "nested",
    "Manifest": "manifest",
    "PendingSave": "checkpointer",
    "Restored": "restore",
    # What they raise.
    "BadName": "names",
    "CoordError": "coord",
    "CorruptStep": "tier",
    "StateError": "codec",
    "TierError": "tier",
    "TierFull": "tier",
    "TiersUnavailable": "restore",
    # Shards and tiers.
    "Buf": "codec",
    "Tier": "tier",
    "checksum": "codec",
    # SLURM_JOB_NODELIST to node names (the rendezvous host of a torch job), as Slurm expands it.
    "expand_hostlist": "gpuwarden.slurm.hostlist:expand",
}

__all__ = [
    "EXIT_REQUEUE",
    "BadName",
    "Buf",
    "CoordError",
    "CorruptStep",
    "JobCheckpointer",
    "JobEnv",
    "JobEnvError",
    "Later",
    "Manifest",
    "PendingSave",
    "Restored",
    "StateError",
    "Tier",
    "TierError",
    "TierFull",
    "TiersUnavailable",
    "checksum",
    "expand_hostlist",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = home.partition(":")
    value = getattr(importlib.import_module(module if attr else f"{__name__}.{home}"),
                    attr or name)
    globals()[name] = value  # imported once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
