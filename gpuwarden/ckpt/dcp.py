"""torch.distributed.checkpoint (DCP) through gpuwarden's tiers: a StorageWriter and a
StorageReader, so a DCP script keeps its planner, sharding and resharding and gets node memory
first, write-behind, verification and walk-back:

    ck = JobCheckpointer.from_slurm()
    dcp.save(state_dict, storage_writer=dcp_writer(ck, step))        # was checkpoint_id=path
    reader = dcp_reader(ck)                                          # every rank: agrees a step
    if reader.step is not None:
        dcp.load(state_dict, storage_reader=reader)                  # was checkpoint_id=path

What a step is stays gpuwarden's: each rank saves its items as one gpuwarden step (manifest last,
checksummed); the coordinator's step also holds DCP's metadata: its items are written in
`write_data`, beside the other ranks', and the step is committed (metadata, then manifest) in
`finish`, after every rank wrote its items. A DCP load needs items other ranks wrote (DCP writes a
replicated tensor once), so the reader agrees on, and restores from, the durable tiers alone
(`JobCheckpointer.restore(durable_only=True)`): each rank verifies the very copy the others will
read, and a damaged one walks every rank back together; other ranks' items then come from the
shared filesystem or S3, verified again. (A job of one rank with no durable tier restores from
node memory.) DCP's coordinator must be rank 0 (SLURM_PROCID 0), which holds the metadata.

DCP's metadata is read with torch's weights-only unpickler (`torch.load(weights_only=True)`),
allowing DCP's metadata classes only. Non-tensor items are unpickled by DCP's own load planner,
as with its FileSystemReader, and only from the job's own verified steps.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from gpuwarden.ckpt.codec import StateError
from gpuwarden.ckpt.names import check_step
from gpuwarden.ckpt.nested import Later

if TYPE_CHECKING:
    from gpuwarden.ckpt.checkpointer import PendingSave
    from gpuwarden.ckpt.job import JobCheckpointer

# Public (the package's docstring): what a DCP script passes to dcp.save and dcp.load.
__all__ = ["GpuwardenReader", "GpuwardenWriter", "dcp_reader", "dcp_writer"]

log = logging.getLogger(__name__)

ITEMS = "dcp"  # this rank's items, by key
METADATA = "dcp_metadata"  # the coordinator's only: DCP's Metadata, torch-saved


@dataclasses.dataclass(frozen=True)
class ItemWhere:
    """Where an item is: the rank that wrote it and its key there (DCP's storage_data)."""

    rank: int
    key: str


def _safe_classes() -> list[Any]:
    """ItemWhere and the classes DCP's metadata module defines (dataclasses and enums: plain
    data, nothing that runs code when unpickled)."""
    own = [v for v in vars(dcp_metadata).values()
           if isinstance(v, type) and v.__module__ == dcp_metadata.__name__]
    return [ItemWhere, *own]


def _dump_metadata(md: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(md, buf)
    return buf.getvalue()


def _load_metadata(raw: Any) -> Any:
    if not isinstance(raw, bytes):
        raise StateError(f"{METADATA}: not a bytes item")
    try:
        with torch.serialization.safe_globals(_safe_classes()):
            md = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # the unpickler's refusals are plain exceptions of many kinds
        raise StateError(f"{METADATA}: cannot be read safely: {exc}") from None
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.storage_data, dict):
        raise StateError(f"{METADATA}: not DCP metadata with storage data")
    return md


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class GpuwardenWriter(StorageWriter):
    """One step's DCP save into gpuwarden's tiers; make one per save (`dcp_writer`)."""

    def __init__(self, ck: JobCheckpointer, step: int) -> None:
        super().__init__()
        self.ck, self.step = ck, check_step(step)
        self.rank = ck.env.rank
        self.is_coordinator = False
        self.items: dict[str, Any] = {}
        self._pending: PendingSave | None = None  # the coordinator's step, until `finish`
        self._metadata: Later | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            try:
                step = int(checkpoint_id)
            except (TypeError, ValueError):
                raise StateError(f"checkpoint_id {checkpoint_id!r}: gpuwarden's checkpoint_id "
                                 "is the step number (dcp_writer(ck, step) sets it; leave "
                                 "checkpoint_id= out)") from None
            self.step = check_step(step)
        self.items = {}
        self._abort()  # a save that failed between write_data and finish left a temp dir

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            # Every rank then coordinates its own save: the step would hold one rank's
            # metadata and the others' items would be overwritten.
            raise StateError("dcp.save(..., use_collectives=False) is not supported: a "
                             "gpuwarden step gathers every rank's results on rank 0 (DCP's "
                             "default, use_collectives=True)")
        if is_coordinator != (self.rank == 0):
            # The reader looks for the metadata in rank 0's step: any other layout would
            # save checkpoints that no load can read.
            raise StateError(f"DCP's coordinator is {'this' if is_coordinator else 'another'} "
                             f"rank, but gpuwarden's rank here is {self.rank}: the process "
                             "group's rank 0 must be SLURM_PROCID 0")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            key = f"{len(self.items):06d}"
            if item.type == WriteItemType.BYTE_IO:
                value: Any = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                size = len(value)
            else:
                value = data.detach()
                size = value.numel() * value.element_size()
            self.items[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=ItemWhere(self.rank, key)))
        if self.is_coordinator:
            # Written now, beside the other ranks' writes; only the metadata, which needs
            # every rank's results, is left for `finish` (the step stays invisible until then).
            self._abort()
            self._metadata = Later()
            self._pending = self.ck.begin(self.step, {ITEMS: self.items,
                                                      METADATA: self._metadata})
        else:
            self.ck.save(self.step, {ITEMS: self.items})
        self.items = {}
        return _done(results)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        # Every rank's items are in its tier 0 now (DCP gathered their results); the
        # coordinator's step, with the metadata, is committed last.
        pending, self._pending = self._pending, None
        if pending is None or self._metadata is None:
            raise StateError("DCP called finish before write_data on the coordinator")
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        try:
            self._metadata.set(_dump_metadata(metadata))
        except BaseException:
            pending.abort()
            raise
        pending.commit()

    def _abort(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.abort()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never chosen by DCP on its own: pass storage_writer=


class GpuwardenReader(StorageReader):
    """A DCP load of the newest step every rank can read; `step` is None when there is none.
    Every rank must create it (the ranks agree on the step as it is made)."""

    def __init__(self, ck: JobCheckpointer) -> None:
        super().__init__()
        self.ck = ck
        self.rank = ck.env.rank
        got = ck.restore(durable_only=True)
        self.step: int | None = None if got is None else got.step
        self._states: dict[int, dict[str, Any]] = {} if got is None else {self.rank: got.state}
        self.storage_data: dict[Any, Any] = {}

    def _state(self, rank: int) -> dict[str, Any]:
        if self.step is None:
            raise StateError("there is no checkpoint to load: check reader.step first")
        if rank not in self._states:
            self._states[rank] = self.ck.load_rank(rank, self.step)
        return self._states[rank]

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if "rank" in kwargs:
            # DCP asks for a rank's own metadata after the global read failed, and then
            # loads that rank alone without collectives: the ranks' collectives would part.
            raise StateError("gpuwarden keeps no per-rank DCP metadata: the step's metadata "
                             "is in rank 0's step")
        md = _load_metadata(self._state(0).get(METADATA))
        if getattr(md, "storage_meta", None) is None and hasattr(dcp_metadata, "StorageMeta"):
            md.storage_meta = dcp_metadata.StorageMeta()
        return md

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _item(self, index: Any) -> Any:
        where = self.storage_data.get(index)
        if not isinstance(where, ItemWhere):
            raise StateError(f"DCP item {index} has no location in step {self.step}'s metadata")
        items = self._state(where.rank).get(ITEMS)
        if not isinstance(items, dict) or where.key not in items:
            raise StateError(f"DCP item {index}: rank {where.rank}'s step {self.step} lacks "
                             f"item {where.key}")
        return items[where.key]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            src = self._item(item.storage_index)
            if item.type == LoadItemType.BYTE_IO:
                if not isinstance(src, bytes):
                    raise StateError(f"DCP item {item.storage_index} is not bytes")
                planner.load_bytes(item, io.BytesIO(src))
                continue
            if not isinstance(src, torch.Tensor):
                raise StateError(f"DCP item {item.storage_index} is not a tensor")
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                      strict=True)):
                src = src.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != src.size():
                raise StateError(f"DCP item {item.storage_index}: {tuple(src.size())} stored, "
                                 f"{tuple(target.size())} wanted")
            target.copy_(src)
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def dcp_writer(ck: JobCheckpointer, step: int) -> GpuwardenWriter:
    return GpuwardenWriter(ck, step)


def dcp_reader(ck: JobCheckpointer) -> GpuwardenReader:
    return GpuwardenReader(ck)
