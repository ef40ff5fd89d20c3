"""What the launcher decides, as pure functions of what it saw: which nodes run which rank,
which rank's node is lost, whether the job hangs, which spare comes next, when to requeue."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from gpuwarden.launch.settings import EXIT_REQUEUE, LaunchSettings


@dataclass(frozen=True)
class Layout:
    ranks: tuple[str, ...]  # the node of rank r, in rank order
    spares: tuple[str, ...]  # idle nodes of the allocation, in the order they are taken
    lost: tuple[str, ...] = ()  # nodes this launcher gave up, never used again


def plan(nodes: Sequence[str], spares: int) -> Layout:
    """Rank r on the r-th node of the allocation; the last ``spares`` nodes idle. The batch
    host (the allocation's first node) thus trains: losing it ends the batch script anyway."""
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"the allocation lists a node twice: {', '.join(nodes)}")
    if len(nodes) <= spares:
        raise ValueError(f"{len(nodes)} node(s) cannot hold {spares} spare(s) and a rank: "
                         f"ask for N+{spares} nodes (#SBATCH -N)")
    cut = len(nodes) - spares
    return Layout(tuple(nodes[:cut]), tuple(nodes[cut:]))


def next_spare(spares: Sequence[str], lost: str, leaf_of: Mapping[str, str]) -> str:
    """The first spare on the lost node's leaf switch (its replacement then talks to the same
    neighbours), else the first spare."""
    leaf = leaf_of.get(lost)
    if leaf is not None:
        for s in spares:
            if leaf_of.get(s) == leaf:
                return s
    return spares[0]


def replace_lost(layout: Layout, lost: Sequence[str],
                 leaf_of: Mapping[str, str] | None = None) -> Layout | None:
    """Each lost node's rank moves to a spare; every other rank stays where its tier 0 is.
    None when the spares do not cover the loss (then: requeue)."""
    ranks, spares = list(layout.ranks), list(layout.spares)
    for node in dict.fromkeys(lost):
        if node not in ranks:
            continue
        if not spares:
            return None
        s = next_spare(spares, node, leaf_of or {})
        spares.remove(s)
        ranks[ranks.index(node)] = s
    return Layout(tuple(ranks), tuple(spares), (*layout.lost, *dict.fromkeys(lost)))


def adopt(layout: Layout, hosts: Sequence[str | None]) -> Layout:
    """The layout as the ranks' own beats report it: Slurm's task placement wins over what
    was asked when they differ (and the launcher says so). Only a reordering of the same
    nodes is adopted; anything else keeps the plan."""
    seen = tuple(h or layout.ranks[r] for r, h in enumerate(hosts))
    if seen == layout.ranks or sorted(seen) != sorted(layout.ranks):
        return layout
    return replace(layout, ranks=seen)


# ---- watching one step ----------------------------------------------------------------------
@dataclass(frozen=True)
class RankView:
    rank: int
    host: str | None  # from its beats; None: none yet
    last: float | None  # the receiver's clock at its newest beat; None: none yet
    progress: int  # -1: no step saved or reported in this launch yet
    done: bool  # finishing: silence is no loss, no progress no hang


@dataclass(frozen=True)
class Lost:
    rank: int
    node: str
    why: str


@dataclass(frozen=True)
class Verdict:
    kind: Literal["running", "exited", "failed", "lost", "hung", "blind"]
    code: int | None = None  # "exited": the status to pass on; "failed": the rank's own
    lost: tuple[Lost, ...] = ()
    why: str = ""


class ProgressWatch:
    """When the job last advanced (the slowest running rank's progress rose), and the longest
    advance seen so far. Armed at the first advance of a launch: before it, start-up and
    restore take what they take. A hang is a gap over max(hang_s, 2 x the longest gap seen,
    the first one measured from the launch), so a job that saves rarely is not called hung
    between two saves."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.value: int | None = None
        self.at = 0.0
        self.beating: float | None = None  # when every rank of this launch had beaten

    def begin(self, now: float) -> None:
        self.value, self.at, self.beating = None, now, None

    def see(self, views: Sequence[RankView], now: float) -> None:
        if self.beating is None and views and all(v.last is not None for v in views):
            self.beating = now
        running = [v.progress for v in views if not v.done]
        low = min(running) if running else -1
        if low >= 0 and (self.value is None or low > self.value):
            self.longest = max(self.longest, now - self.at)
            self.value, self.at = low, now

    def allowed(self, hang_s: float) -> float:
        return max(hang_s, 2 * self.longest)

    def hung(self, views: Sequence[RankView], now: float, hang_s: float,
             first_s: float = 0.0) -> bool:
        """``first_s``: what a launch may take from every rank beating to its first progress
        (restore, the first collective: a hang there is the most common one)."""
        if hang_s == 0 or all(v.done for v in views):
            return False
        if self.value is None:
            return self.beating is not None and now - self.beating >= max(hang_s, first_s)
        return now - self.at >= self.allowed(hang_s)


def silent(views: Sequence[RankView], layout: Layout, started: float, now: float,
           s: LaunchSettings, exits: Mapping[int, int] | None = None) -> list[Lost]:
    """Running ranks whose beats stopped for deadline_s, or never came within start_s. A rank
    that ended by itself (``exits``: its node reported it) lost no node."""
    out = []
    for v in views:
        node = v.host or layout.ranks[v.rank]
        if v.done or v.rank in (exits or {}):
            continue
        if v.last is None and now - started >= s.start_s:
            out.append(Lost(v.rank, node, f"no heartbeat within {s.start_s:g} s of the start"))
        elif v.last is not None and now - v.last >= s.deadline_s:
            out.append(Lost(v.rank, node, f"no heartbeat for {now - v.last:.1f} s "
                                          f"(deadline {s.deadline_s:g} s)"))
    return out


def with_quiet(lost: list[Lost], views: Sequence[RankView], layout: Layout, now: float,
               s: LaunchSettings, exits: Mapping[int, int]) -> list[Lost]:
    """A node is lost: others silent for longer than a healthy rank ever is (two beats, and
    half the deadline against a loaded machine's stalls) went with it (a rack's power, a
    leaf switch); relaunching onto them would fail or cost another deadline."""
    quiet_s = max(2 * s.beat_s, s.deadline_s / 2)
    named = {x.rank for x in lost}
    more = [Lost(v.rank, v.host or layout.ranks[v.rank],
                 f"no heartbeat for {now - v.last:.1f} s when another node was lost")
            for v in views if v.rank not in named and not v.done and v.rank not in exits
            and v.last is not None and now - v.last >= quiet_s]
    return lost + more


def judge(views: Sequence[RankView], layout: Layout, started: float, now: float,
          s: LaunchSettings, watch: ProgressWatch, code: int | None,
          failed_nodes: Sequence[str] = (), exits: Mapping[int, int] | None = None) -> Verdict:
    """One look at a step. ``code``: srun's exit status, None while it runs;
    ``failed_nodes``: nodes srun itself reported failed; ``exits``: ranks that ended by
    themselves non-zero (their own status, as srun printed it)."""
    mapping = {v.host or layout.ranks[v.rank]: v.rank for v in views}
    # A task on a node srun reported failed did not end by itself, whatever srun said of it.
    down = {mapping[n] for n in failed_nodes if n in mapping}
    exits = {r: c for r, c in (exits or {}).items() if r not in down}
    lost = silent(views, layout, started, now, s, exits)
    running = [v for v in views if not v.done and v.rank not in exits]
    # A rank's own failure (not 75: a save at the time limit).
    own = [c for _r, c in sorted(exits.items()) if c not in (0, EXIT_REQUEUE)]
    # Every running rank silent at once says more about the launcher's side (its network,
    # the training not using JobCheckpointer) than about the nodes: no spare is spent on it.
    # Not when the others failed meanwhile: ranks whose collective broke on a vanished peer
    # (gloo, NCCL) exit, and the silent ones are what they lost.
    blind = bool(running) and len(lost) == len(running) and not own
    if blind:
        lost = []
    named = {x.node for x in lost}
    lost += [Lost(mapping[n], n, "srun reported the node failed") for n in failed_nodes
             if n in mapping and n not in named]
    if lost:
        lost = with_quiet(lost, views, layout, now, s, exits)
    if code is not None:
        return _ended(code, own, lost)
    # A lost node explains the others' failures (their collectives broke on it); a rank's own
    # failure with every other node alive is the program's, never a node's.
    if lost:
        return Verdict("lost", lost=tuple(lost))
    if own:
        rank = min(r for r, c in exits.items() if c == own[0])
        return Verdict("failed", code=own[0], why=f"rank {rank} exited {own[0]}")
    if blind:
        return Verdict("blind", why=f"no heartbeat from any of {len(running)} running ranks")
    if watch.hung(views, now, s.hang_s, s.start_s):
        since = watch.at if watch.value is not None else (watch.beating or watch.at)
        return Verdict("hung", why=f"no training progress for {now - since:.0f} s, "
                                   "every rank alive")
    return Verdict("running")


def _ended(code: int, own: Sequence[int], lost: Sequence[Lost]) -> Verdict:
    if lost and code not in (0, EXIT_REQUEUE):
        return Verdict("lost", lost=tuple(lost))  # the failures it explains are not the job's
    if own:
        return Verdict("exited", code=own[0])  # its own status, not the others' signal
    return Verdict("exited", code=code)  # done, a requeue asked for, or the job's own


def after_hang(hang_relaunches_done: int, s: LaunchSettings) -> bool:
    """True: relaunch on the same nodes; False: requeue (a hang that comes back is the job's
    or its nodes' and needs fresh ones)."""
    return hang_relaunches_done < s.hang_relaunches
