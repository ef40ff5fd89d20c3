"""The authenticated index of a job's S3 steps (issue 37; docs/design/object-store-sites.md 4.2).

After a rank's manifest, `S3Tier.commit` writes an empty object

    <prefix>/<job>/index/step-SSSSSSSSSSSS/rank-RRRRR.w<W>.<kid>.<tag>

``tag`` = the first 32 hex digits of HMAC-SHA256(job key of ``kid``,
``"gpuwarden-s3-index\\0" job \\0 rank \\0 step \\0 W``); the key id is empty for a shared tier's
``peer.key`` (`jobkey.LEGACY`). So one paginated LIST of ``<job>/index/`` tells which steps every
rank holds, without a LIST (or a manifest GET) per rank. The bucket is shared by every user's
jobs, so a name is trusted only once its tag verifies under this job's key of the kid it names:
a malformed name, an unknown kid, a wrong tag are refused and counted (the caller logs "N index
names refused"), never raised. A verified name is still only a hint: the step's manifest and MAC
are verified when it is read, and the job's own agreement decides what it restores.

Pure: names in, markers out (the LIST is `S3Tier.index`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpuwarden.ckpt.jobkey import JobKeys
from gpuwarden.ckpt.names import MAX_STEP, step_dir

INDEX = "index"  # <prefix>/<job>/index/
LABEL = b"gpuwarden-s3-index\0"
TAG_HEX = 32
MAX_WORLD = 10**9 - 1  # at most 9 digits, as ranks
_MARKER = re.compile(r"step-([0-9]{12})/rank-([0-9]{5,9})\.w([1-9][0-9]{0,8})"
                     r"\.([A-Za-z0-9_-]{0,32})\.([0-9a-f]{32})")


def tag(key: bytes, job: str, rank: int, step: int, world: int) -> str:
    """The marker's tag: what makes a name the job's own."""
    message = LABEL + b"\0".join(str(v).encode() for v in (job, rank, step, world))
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:TAG_HEX]


def rank_prefix(step: int, rank: int) -> str:
    """What every marker of ``rank`` at ``step`` starts with, whatever its world and kid
    (the dot ends the rank: rank 1's prefix is not rank 10's)."""
    return f"{step_dir(step)}/rank-{rank:05d}."


def marker_name(signing: tuple[str, bytes], job: str, rank: int, step: int, world: int) -> str:
    """The marker's name under ``<prefix>/<job>/index/``, made with the signing key."""
    if not 0 <= rank < world <= MAX_WORLD:
        raise ValueError(f"rank {rank} of {world}: not a rank of that world")
    kid, key = signing
    return f"{rank_prefix(step, rank)}w{world}.{kid}.{tag(key, job, rank, step, world)}"


@dataclass(frozen=True)
class Marker:
    """A verified marker: ``rank`` of a job of ``world`` ranks committed ``step``."""

    step: int
    rank: int
    world: int
    kid: str


def verify(name: str, keys: JobKeys | None, job: str) -> Marker | None:
    """The marker ``name`` (under the index prefix) stands for, when this job's key of the
    kid it names made it; None for anything else. Never raises."""
    if keys is None or not isinstance(name, str):
        return None
    m = _MARKER.fullmatch(name)
    if m is None:
        return None
    step, rank, world, kid = int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)
    # Canonical text only (the tag covers the numbers, so "rank-000003" would be a second
    # name for one marker).
    if f"{rank:05d}" != m.group(2) or not (step < MAX_STEP and rank < world):
        return None
    key = keys.by_kid.get(kid)
    if key is None or not hmac.compare_digest(m.group(5), tag(key, job, rank, step, world)):
        return None
    return Marker(step, rank, world, kid)


@dataclass(frozen=True)
class Index:
    """The verified markers of a job's index, and how many names were refused."""

    markers: tuple[Marker, ...]
    refused: int

    @classmethod
    def read(cls, names: Iterable[str], keys: JobKeys | None, job: str) -> Index:
        found: set[Marker] = set()
        refused = 0
        for name in names:
            marker = verify(name, keys, job)
            if marker is None:
                refused += 1
            else:
                found.add(marker)
        return cls(tuple(sorted(found, key=lambda m: (m.world, m.rank, m.step, m.kid))), refused)

    def worlds(self) -> list[int]:
        return sorted({m.world for m in self.markers})

    def held(self, world: int) -> dict[int, list[int]]:
        """{rank: [steps]} of the markers that say the job has ``world`` ranks: what
        `stagein.select` takes."""
        out: dict[int, set[int]] = {}
        for m in self.markers:
            if m.world == world:
                out.setdefault(m.rank, set()).add(m.step)
        return {r: sorted(s) for r, s in sorted(out.items())}

    def complete(self, world: int) -> list[int]:
        """The steps every one of ``world`` ranks holds, newest first (a node that cannot use
        the newest walks back along these)."""
        held = self.held(world)
        if len(held) < world:
            return []
        common = set(held[0]).intersection(*(held[r] for r in range(1, world)))
        return sorted(common, reverse=True)

    def newest(self) -> tuple[int, int] | None:
        """(step, world): the newest step all ranks of some world hold; None if none."""
        best = [(steps[0], w) for w in self.worlds() if (steps := self.complete(w))]
        return max(best) if best else None


def held_from_index(names: Iterable[str], keys: JobKeys | None, job: str,
                    world: int) -> dict[int, list[int]]:
    """{rank: [steps]} of the verified names saying ``world`` ranks (refused ones dropped)."""
    return Index.read(names, keys, job).held(world)

