"""What every checkpoint tier shares: the `Tier` protocol restore reads through, the errors a
tier raises, the manifest's name and the rules each tier applies to what it writes and reads.

The tiers themselves (`fstier`: node memory and the shared filesystem; `peer`: other nodes'
memory; `s3tier`: S3) import these from here, so none of them needs another tier's module.
"""

from __future__ import annotations

from typing import Protocol

from gpuwarden.ckpt.codec import Buf, checksum
from gpuwarden.ckpt.manifest import VERSION, Manifest, Shard
from gpuwarden.core.errors import GpuwardenError

MANIFEST = "MANIFEST.json"  # a step's manifest, beside its shards, written last on every tier


class Tier(Protocol):
    name: str

    def steps(self) -> list[int]: ...
    def load(self, step: int) -> tuple[Manifest, dict[str, Buf]]: ...


class TierError(GpuwardenError):
    """A tier that cannot be used (unsafe directory, I/O error)."""


class TierFull(TierError):
    """Out of space or inodes: the step was not committed; the previous ones are intact."""


class CorruptStep(GpuwardenError):
    """A committed step that cannot be used: bytes or manifest that do not match, a link,
    another user's file, a file that is not a regular one."""


def check_shard(tier: str, step: int, shard: Shard,
                data: Buf) -> None:
    """Every tier's rule: nothing read back is used before size and checksum match."""
    if memoryview(data).nbytes != shard.size or checksum(data) != shard.checksum:
        raise CorruptStep(f"{tier} step {step}: shard {shard.name}: checksum mismatch")


def check_writable(tier: str, manifest: Manifest) -> None:
    """Legacy manifests are read, never written (a new step always gets a digest)."""
    if manifest.version != VERSION:
        raise TierError(f"{tier}: step {manifest.step} has a version-{manifest.version} "
                        f"manifest: legacy manifests are read-only; save the state again")
