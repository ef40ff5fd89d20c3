"""Records parsed from Slurm's output. Frozen: they are facts read at one moment."""

from __future__ import annotations

from dataclasses import dataclass

REASON_PREFIX = "gpuwarden:"
# slurmctld's set_node_reason() appends " : <msg>" to a reason already set ("Not responding",
# "reboot issued", "ResumeTimeout reached") and re-stamps it. gpuwarden_reason() never writes
# this separator itself, so in a gpuwarden reason the first one starts what Slurm added.
SLURM_APPENDS = " : "


def own_part(reason: str) -> str:
    """A reason without what slurmctld appended to it."""
    return reason.split(SLURM_APPENDS, 1)[0]


def same_drain(reason: str, ours: str) -> bool:
    """True when ``reason`` is the drain reason ``ours``, with or without Slurm's additions."""
    ours = own_part(ours)
    return bool(ours) and (reason == ours or reason.startswith(ours + SLURM_APPENDS))

# Node state flags (data_parser v0.0.40+ lists base state and flags together).
_UNAVAILABLE = frozenset({"DRAIN", "DOWN", "FAIL", "FAILING"})


@dataclass(frozen=True)
class Node:
    name: str
    state: tuple[str, ...]
    reason: str
    reason_set_by: str
    reason_changed_at: int | None
    partitions: tuple[str, ...]
    gres: str
    features: tuple[str, ...]
    boot_time: int | None
    comment: str = ""
    # Slurm's free-form node `Extra` (23.02+): health gating keeps its marker there.
    extra: str = ""

    @property
    def state_text(self) -> str:
        return "+".join(self.state) if self.state else "UNKNOWN"

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.state

    @property
    def down(self) -> bool:
        return "DOWN" in self.state or "FAIL" in self.state

    @property
    def unavailable(self) -> bool:
        return bool(_UNAVAILABLE & set(self.state))

    @property
    def reason_is_ours(self) -> bool:
        return self.reason.startswith(REASON_PREFIX)

    @property
    def restamped(self) -> bool:
        """A gpuwarden reason slurmctld has appended to: its stamp is that of the append,
        later than the drain's own."""
        return self.reason_is_ours and SLURM_APPENDS in self.reason

    @property
    def owner(self) -> str:
        """Who set the current reason, as an operator reads it."""
        if not self.reason:
            return ""
        if self.reason_is_ours:
            return "gpuwarden"
        return self.reason_set_by or "slurm"


@dataclass(frozen=True)
class NodeView:
    """Some nodes as one controller read returned them, with the controller's own clock.

    ``ctld_time`` is the response's top-level ``last_update``: when slurmctld last changed its
    node table, by slurmctld's clock (the clock that also stamps ``reason_changed_at``), so it
    never depends on the reading host's clock.
    """

    nodes: tuple[Node, ...]
    ctld_time: int | None

    def get(self, name: str) -> Node | None:
        return next((n for n in self.nodes if n.name == name), None)


@dataclass(frozen=True)
class Job:
    """A job as the controller sees it now (scontrol show job)."""

    job_id: int
    name: str
    user: str
    state: tuple[str, ...]
    state_reason: str
    partition: str
    nodes: str
    num_nodes: int
    restart_count: int
    exit_code: int | None
    admin_comment: str
    comment: str
    # When the job ends at the latest: its start plus its time limit while it runs (Slurm's
    # own estimate while it is pending); None when unset or unlimited.
    end_time: int | None = None
    # --switches as the controller holds it now (0: none) and its wait in seconds.
    req_switch: int = 0
    switch_wait_s: int = 0


@dataclass(frozen=True)
class AcctJob:
    """A job as accounting recorded it (sacct)."""

    job_id: int
    name: str
    user: str
    state: str
    state_reason: str
    partition: str
    nodes: str
    num_nodes: int
    gpus: int
    exit_code: int | None
    signal: int | None
    submit_time: int | None
    start_time: int | None
    end_time: int | None
    # None where accounting does not say: sacct's JSON has restart_cnt only from data_parser
    # v0.0.42 (Slurm 24.11) on, so on 23.11/24.05 a count is unknown, not 0.
    restart_count: int | None
    # The lemon detector's evidence: the node Slurm blamed for a NODE_FAIL, and the submit
    # command (to see jobs that pinned nodes by name with -w/--nodelist, and the job script).
    failed_node: str = ""
    submit_line: str = ""


@dataclass(frozen=True)
class NodeEvent:
    """A node state change recorded by slurmdbd (sacctmgr show events)."""

    cluster: str
    node: str
    start: str
    end: str
    state: str
    reason: str
    user: str
