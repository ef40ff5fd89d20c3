"""`gpuwarden ckpt ls`: a job's committed steps, one row per tier and rank, each saying where it
is: this host's memory (tier 0 of the ranks that ran here), the replicas this host holds for
other ranks (peer), the shared filesystem and S3. Every rank is listed unless one is asked for:
a row that does not say its rank and host reads as the whole job's."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpuwarden.ckpt.fstier import ANY_JOB_USER, FsTier
from gpuwarden.ckpt.names import PEER_SUFFIX
from gpuwarden.ckpt.restore import COPY_ERRORS
from gpuwarden.ckpt.tier import TierError
from gpuwarden.core import safefs as safeio

_RANK_DIR = re.compile(r"rank-([0-9]{5,9})")
# A job's directory is its user's: a million planted rank directories must not make root's
# `ckpt ls` run for minutes. No real job has this many ranks per tier.
MAX_RANKS = 100_000


@dataclass(frozen=True)
class Row:
    tier: str  # memory, peer, shared, s3
    where: str  # "c3 (this host)", the shared root, s3://bucket/prefix
    rank: int | None  # None: no rank (nothing there, or the tier could not be listed)
    steps: tuple[int, ...] = ()
    error: str = ""
    # Steps older than the newest `keep` that retention leaves because another rank still
    # needs them (see `needed`), and why, as `ls` shows it.
    needed: tuple[int, ...] = ()
    why_needed: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "steps": list(self.steps), "needed": list(self.needed)}


def this_host() -> str:
    return f"{os.uname().nodename.split('.')[0]} (this host)"


def where(tier: Any) -> str:
    if isinstance(tier, FsTier):
        return this_host() if tier.name in ("memory", "peer") else tier.root
    return f"s3://{tier.s.bucket}/{tier.s.prefix}"


def with_peer(tiers: list[Any]) -> list[Any]:
    """The tiers, with this host's replicas of other ranks (``<job>.peer``) after its memory."""
    out: list[Any] = []
    for t in tiers:
        out.append(t)
        if isinstance(t, FsTier) and t.name == "memory" and not t.namespace.endswith(PEER_SUFFIX):
            out.append(FsTier("peer", t.root, t.namespace + PEER_SUFFIX, 0, t.owner))
    return out


def at_rank(tier: Any, rank: int) -> Any:
    """The same tier, for another rank of the job."""
    if isinstance(tier, FsTier):
        return FsTier(tier.name, tier.root, tier.namespace, rank, tier.owner)
    # The job's keys as they are (derived ones name their kid: ``key=`` would make them a
    # shared tier's key, which verifies no other rank's step).
    return type(tier)(tier.name, tier.s, tier.job, rank, s3=tier.s3, keys=tier.keys)


def _s3_index(tier: Any) -> Any:
    """The S3 job's index, read once for all its ranks (None: not S3, or no key to verify
    its markers with: each rank's steps are then listed alone)."""
    if isinstance(tier, FsTier) or getattr(tier, "keys", None) is None:
        return None
    return tier.index()


def _held(tier: Any, rank: int, index: Any) -> list[int]:
    t = tier if rank == tier.rank else at_rank(tier, rank)
    return list(t.steps() if index is None else t.held(index).steps)


def ranks(tier: Any) -> list[int]:
    """The ranks with a directory (a prefix in S3) under the job's on this tier, in order; []
    when the job has none there. TierError when it cannot be listed."""
    names = _fs_names(tier) if isinstance(tier, FsTier) else _s3_names(tier)
    found: list[int] = []
    for name in names:
        m = _RANK_DIR.fullmatch(name)
        if m:
            found.append(int(m.group(1)))
            if len(found) > MAX_RANKS:
                raise TierError(f"{tier.name}: more than {MAX_RANKS} rank directories under "
                                f"job {tier.job}: give --rank")
    return sorted(found)


def _fs_names(tier: FsTier) -> Iterator[str]:
    path = os.path.join(tier.root, tier.namespace)
    # The job's directory only has to be a real directory writable by its owner alone (root
    # lists any user's job); each rank's is then held to that owner when its steps are read.
    owner = None if tier.owner == ANY_JOB_USER else tier.owner
    try:
        fd = safeio.walk(tier.root, [tier.namespace], owner)
    except FileNotFoundError:
        return
    except safeio.Refused as exc:
        raise TierError(f"{tier.name}: {exc}: refusing it") from None
    except OSError as exc:
        raise TierError(f"{tier.name}: cannot list {path} ({exc.strerror})") from None
    with safeio.closing(fd), os.scandir(fd) as entries:
        for e in entries:
            yield e.name


def _s3_names(tier: Any) -> Iterator[str]:
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 - S3 only

    base = f"{tier.s.prefix}/{tier.job}/"
    try:
        pages = tier.s3.get_paginator("list_objects_v2").paginate(
            Bucket=tier.s.bucket, Prefix=base, Delimiter="/")
        for page in pages:
            for p in page.get("CommonPrefixes", []):
                yield p["Prefix"][len(base):].rstrip("/")
    except (BotoCoreError, ClientError) as exc:
        raise TierError(f"{tier.name}: cannot list s3://{tier.s.bucket}/{base} ({exc})") from None


def rows(tiers: Iterable[Any], rank: int | None) -> Iterator[Row]:
    """One row per tier and rank: ``rank`` only, or every rank the tier holds."""
    for t in tiers:
        place = where(t)
        try:
            wanted = [rank] if rank is not None else ranks(t)
        except TierError as exc:
            yield Row(t.name, place, None, error=str(exc))
            continue
        if not wanted:
            yield Row(t.name, place, None)
        try:
            index = _s3_index(t) if len(wanted) > 1 else None
        except TierError as exc:
            yield Row(t.name, place, None, error=str(exc))
            continue
        for r in wanted:
            try:
                yield Row(t.name, place, r, tuple(_held(t, r, index)))
            except TierError as exc:
                yield Row(t.name, place, r, error=str(exc))


DURABLE = ("shared", "s3")


def needed(rs: list[Row], keep: int) -> list[Row]:
    """The rows, each durable tier's marked with the steps retention keeps beyond ``keep``
    because another rank needs them: every step from the oldest of the ranks' newest steps on
    (the newest step every rank holds, the one a restart takes) is kept. Only with every
    rank listed (a rank with no step there: nothing is marked, retention deletes nothing).
    Pure."""
    floors: dict[str, tuple[int, list[int]]] = {}
    for tier in DURABLE:
        mine = [r for r in rs if r.tier == tier]
        if not mine or any(r.rank is None or r.error or not r.steps for r in mine):
            continue
        floor = min(r.steps[-1] for r in mine)
        floors[tier] = (floor, [r.rank for r in mine if r.rank is not None
                                and r.steps[-1] == floor])
    out = []
    for r in rs:
        if r.tier not in floors:
            out.append(r)
            continue
        floor, low = floors[r.tier]
        extra = tuple(s for s in r.steps[:-keep] if s >= floor)
        out.append(replace(r, needed=extra, why_needed=(
            f"kept beyond keep={keep}: the newest step {_who(low)}, which a restart "
            "restores") if extra else ""))
    return out


def restart_floor(tier: Any) -> tuple[int | None, str]:
    """The step a restart restores from ``tier`` (the oldest of the job's ranks' newest steps
    there), which retention keeps with every step after it, and who holds it; or None and
    why it cannot be known (retention then deletes nothing there, as the writer does): no
    readable step of this rank to take the world size from, a world past `MAX_RANKS`, or a
    rank with no verified step there yet (its first may be any step the others hold; on S3
    a step name counts once its index marker, or its manifest, verifies). What `needed`
    marks, read from the tier itself for one rank's `gc`. TierError when a rank's directory
    cannot be listed."""
    ws = None
    for s in reversed(tier.steps()):
        try:
            ws = tier.manifest(s).world_size
            break
        except COPY_ERRORS:
            continue  # refused: left in place by retention, and no word on the world
    if ws is None:
        return None, "no readable step gives the job's world size"
    if ws > MAX_RANKS:
        return None, f"the world size {ws} is more than {MAX_RANKS}"
    # On S3 a rank's step names are anyone's to write: its newest step is the newest whose
    # index marker verifies under the job's keys, or (a step from before the index) whose
    # manifest does; an unverified name never moves the floor.
    index = _s3_index(tier)
    newest: dict[int, int] = {}
    for r in range(ws):
        found, listed = _newest_verified(tier if r == tier.rank else at_rank(tier, r), index)
        if found is None:
            return None, f"rank {r} holds no {'verified ' if listed else ''}step there yet"
        newest[r] = found
    floor = min(newest.values())
    return floor, f"the newest step {_who([r for r, s in newest.items() if s == floor])}"


def _newest_verified(t: Any, index: Any) -> tuple[int | None, bool]:
    """The rank's newest step that verifies (None: none), and whether it lists any."""
    if isinstance(t, FsTier):  # the job's own directory: only its user writes there
        held = t.steps()
        return (held[-1] if held else None), bool(held)
    got = t.held(index)
    for s in reversed(got.steps):
        if s in got.marked:
            return int(s), True
        try:
            t.manifest(s)  # MAC'd under the job's keys
            return int(s), True
        except COPY_ERRORS:
            continue
    return None, bool(got.steps)


def _who(ranks_: list[int]) -> str:
    shown = ",".join(map(str, ranks_[:8])) + (",..." if len(ranks_) > 8 else "")
    return f"rank {shown} holds" if len(ranks_) == 1 else f"ranks {shown} hold"


def _runs(rs: list[Row]) -> Iterator[tuple[str, Row]]:
    """Consecutive ranks of one tier with the same steps, as one line: "0-63"."""
    runs: list[tuple[int | None, int | None, Row]] = []
    for r in rs:
        if runs:
            first, last, head = runs[-1]
            if (r.tier == head.tier and r.rank is not None and last is not None
                    and r.rank == last + 1 and (r.steps, r.error, r.needed)
                    == (head.steps, head.error, head.needed)):
                runs[-1] = (first, r.rank, head)
                continue
        runs.append((r.rank, r.rank, r))
    for first, last, r in runs:
        yield ("-" if first is None else str(first) if first == last else f"{first}-{last}"), r


def _steps(r: Row, job: str) -> str:
    if r.error:
        return f"unavailable: {r.error}"
    if r.rank is None:
        return f"no steps of {job}"
    shown = ", ".join(map(str, r.steps[-10:])) or "none"
    if r.needed:
        shown += f"; {', '.join(map(str, r.needed))} ({r.why_needed})"
    return f"{len(r.steps)} step(s): {shown}"


def table(rs: list[Row], job: str) -> list[str]:
    """The rows as aligned lines under a header; ranks with the same steps share a line."""
    lines = [(label, r) for label, r in _runs(rs)]
    rank_w = max([4, *(len(label) for label, _ in lines)])
    where_w = max([5, *(len(r.where) for _, r in lines)])
    out = [f"{'TIER':<8} {'RANK':<{rank_w}} {'WHERE':<{where_w}} STEPS"]
    out += [f"{r.tier:<8} {label:<{rank_w}} {r.where:<{where_w}} {_steps(r, job)}"
            for label, r in lines]
    return out
