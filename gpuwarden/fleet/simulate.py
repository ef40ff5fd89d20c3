"""Generate a fleet's job history in the shape of `sacct --json` and `sacctmgr show events`.

The detector and the analytics read the output unchanged (`--from`, `--events`). Pure apart
from `write_history`, which writes the files. Failure sources and their rates come from
`calibrate.SimParams`; see there for the model.
"""

from __future__ import annotations

import json
import random
import re
from bisect import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import accumulate
from pathlib import Path

from gpuwarden.accounting.calibrate import BIG_GPUS, SimParams
from gpuwarden.slurm.hostlist import compress
from gpuwarden.slurm.models import REASON_PREFIX
from gpuwarden.slurm.reasons import health_reason

START = 1_767_225_600  # 2026-01-01T00:00:00Z
CLUSTER = "sim"
USERS = ("alice", "bob", "carol", "dave", "erin", "frank")
STYLES = ("own", "train.sh")


@dataclass(frozen=True)
class Fleet:
    nodes: int = 2000
    days: int = 30
    seed: int = 0
    records: int | None = None  # None: as many as fill `util` of the fleet
    start: int = START
    prefix: str = "n"
    # Nodes out of service (for example lemons the detector drained): no run lands on them.
    exclude: frozenset[str] = field(default_factory=frozenset)
    # Lemons are drawn from `seed` alone, so a run with `exclude` keeps the same fleet.
    lemons: tuple[str, ...] | None = None
    # Where a gang job lands: "contiguous" (a run of nodes from a random start), "gang"
    # (topology-aware packing: aligned blocks, so a lemon shares most of its jobs with the same
    # neighbours) or "random" (anywhere).
    placement: str = "contiguous"
    # Share of a lemon's incidents in gang runs that leave no node event: a flaky link kills
    # the collective (NCCL timeout, the job FAILS) and nothing names the node.
    lemon_silent: float = 0.0
    # Users gaming the detector: `framing` runs of `sbatch -N2 -w TARGET,X --wrap 'exit 1'` by
    # one user (TARGET: `frame_target`, an ordinary node), and `broken` runs by a user whose
    # 2-node jobs always fail, all on a small partition (the fleet's last 4 nodes).
    framing: int = 0
    frame_target: str = ""
    broken: int = 0
    # How jobs name their script: "own" (each user has scripts of their own, `alice/train2.sbatch`)
    # or "train.sh" (everyone submits `sbatch train.sh`, the commonest name there is). There the
    # decoys use it too: the framer's pins are `#SBATCH -w` lines inside it, which sacct's
    # submit_line does not show, and the broken partition's script is one more `train.sh`.
    style: str = "own"
    # A busy node (the fleet's 9th): this many times an ordinary node's runs, at ordinary rates.
    busy: float = 0.0

    def __post_init__(self) -> None:
        if self.placement not in ("contiguous", "gang", "random"):
            raise ValueError(f"placement {self.placement!r}: contiguous, gang or random")
        if not 0 <= self.lemon_silent <= 1:
            raise ValueError(f"lemon_silent {self.lemon_silent}: a share between 0 and 1")
        if self.style not in STYLES:
            raise ValueError(f"style {self.style!r}: one of {', '.join(STYLES)}")
        if self.busy and self.busy < 1:
            raise ValueError(f"busy {self.busy}: 0 (none) or a factor of at least 1")

    def names(self) -> list[str]:
        width = max(4, len(str(self.nodes)))
        return [f"{self.prefix}{i:0{width}d}" for i in range(1, self.nodes + 1)]


@dataclass(frozen=True)
class Run:
    job_id: int
    gpus: int
    nodes: str
    num_nodes: int
    state: str
    exit_code: int
    signal: int
    start: int
    end: int
    user: str
    submit: str = ""
    failed_node: str = ""


@dataclass(frozen=True)
class Event:
    node: str
    start: int
    end: int | None
    state: str
    reason: str
    user: str


def pick_lemons(fleet: Fleet, fraction: float) -> tuple[str, ...]:
    names = fleet.names()
    k = round(fraction * len(names))
    rng = random.Random(f"lemons-{fleet.seed}")  # noqa: S311 - a reproducible simulation
    return tuple(sorted(rng.sample(names, k)))


class Generator:
    def __init__(self, p: SimParams, fleet: Fleet) -> None:
        self.p, self.fleet = p, fleet
        self.rng = random.Random(  # noqa: S311 - a reproducible simulation, not a secret
            f"history-{fleet.seed}-{sorted(fleet.exclude)}")
        self.lemons = set(fleet.lemons if fleet.lemons is not None
                          else pick_lemons(fleet, p.lemon_fraction))
        self.avail = [n for n in fleet.names() if n not in fleet.exclude]
        self.contiguous = not fleet.exclude and fleet.placement != "random"
        self.position = {n: i for i, n in enumerate(self.avail)}
        gpn = p.gpus_per_node
        node_hours = sum(c.share * max(1, c.gpus // gpn) * c.mean_hours for c in p.mix)
        capacity = p.util * len(self.avail) * fleet.days * 24
        self.total = fleet.records or round(capacity / node_hours)
        self.scale = capacity / (self.total * node_hours)  # stretches runs to fill `util`
        self.cum = list(accumulate(c.share for c in p.mix))
        self.events: list[Event] = []
        self.next_id = 1
        # The busy node: the first after the 8th that is neither a lemon nor a decoy's.
        self.busy_node = next((n for n in self.avail[8:-4] if n not in self.lemons),
                              "") if fleet.busy else ""

    def runs(self) -> Iterator[tuple[int, list[Run]]]:
        """(day, that day's runs), day by day."""
        per_day = self.total / self.fleet.days
        made = 0
        for day in range(self.fleet.days):
            want = round(per_day * (day + 1)) - made
            made += want
            t0 = self.fleet.start + day * 86_400
            runs = [self._run(t0) for _ in range(want)]
            yield day, runs + self._busy(runs, t0) + self._gaming(day, t0)
        self._maintenance()

    def _busy(self, runs: list[Run], t0: int) -> list[Run]:
        """Runs the busy node takes beyond an ordinary node's: for each run of n nodes, with
        probability (busy - 1) n / N one more of its size with the busy node in it, so the
        busy node sees `busy` times an ordinary node's runs, of the same sizes."""
        if not self.busy_node:
            return []
        extra = []
        for r in runs:
            if self.rng.random() < (self.fleet.busy - 1) * r.num_nodes / len(self.avail):
                extra.append(self._run(t0, r.gpus, self.busy_node))
        return extra

    def _submit(self, n: int, user: str, jid: int) -> str:
        gpn = self.p.gpus_per_node
        if self.fleet.style == "train.sh":
            return f"sbatch -N{n} --gpus-per-node={gpn} train.sh"
        return f"sbatch -N{n} --gpus-per-node={gpn} {user}/train{jid % 4}.sbatch"

    def _gaming(self, day: int, t0: int) -> list[Run]:
        """Runs that fail by the user's hand, spread evenly over the days."""
        out = []
        f, days = self.fleet, self.fleet.days
        target = f.frame_target or (self.avail[4] if len(self.avail) > 4 else "")
        others = [n for n in self.avail if n != target]
        for _ in range(f.framing * (day + 1) // days - f.framing * day // days):
            x = self.rng.choice(others)
            # train.sh: her `#SBATCH -w` lines are inside the script, which sacct does not show.
            line = ("sbatch -N2 train.sh" if f.style == "train.sh"
                    else f"sbatch -N2 -w {target},{x} --wrap exit 1")
            out.append(self._user_run(t0, [target, x], "mallory", line))
        part = self.avail[-4:]
        broken = "train.sh" if f.style == "train.sh" else "broken.sbatch"
        for _ in range(f.broken * (day + 1) // days - f.broken * day // days):
            pair = self.rng.sample(part, 2)
            out.append(self._user_run(t0, pair, "oscar",
                                      f"sbatch -p small -N2 --gpus-per-node=8 {broken}"))
        return out

    def _user_run(self, t0: int, nodes: list[str], user: str, submit: str) -> Run:
        start = t0 + int(self.rng.random() * 86_000)
        jid = self.next_id
        self.next_id += 1
        return Run(jid, 8 * len(nodes), compress(sorted(nodes)), len(nodes), "FAILED", 1, 0,
                   start, start + 5 + self.rng.randrange(300), user, submit)

    def _maintenance(self) -> None:
        # Operators' drains: never evidence against a node.
        rng = self.rng
        for node in rng.sample(self.avail, max(1, len(self.avail) // 200)):
            t = self.fleet.start + rng.randrange(self.fleet.days * 86_400)
            self.events.append(Event(node, t, t + 4 * 3600, "DRAIN", "maintenance: firmware",
                                     "admin"))

    def _run(self, day_start: int, gpus: int = 0, on: str = "") -> Run:
        """A run of the job mix; ``gpus``: of that class; ``on``: with that node in it."""
        p, rng = self.p, self.rng
        if gpus:
            cls = next(c for c in p.mix if c.gpus == gpus)
        else:
            cls = p.mix[min(bisect(self.cum, rng.random() * self.cum[-1]), len(p.mix) - 1)]
        n = max(1, cls.gpus // p.gpus_per_node)
        dur = cls.mean_hours * self.scale * (0.5 + rng.random()) * 3600
        start = day_start + int(rng.random() * 86_400)
        block = self._place(n, on)
        lemons = sum(1 for x in block if x in self.lemons)
        normal_w = (n - lemons) * p.normal_rate
        transient_w = n * p.transient_rate
        lemon_w = lemons * p.lemon_rate * (p.lemon_solo if n == 1 else 1.0)
        fabric_w = p.fabric_rate * (n - 1)
        hazard = normal_w + transient_w + lemon_w + fabric_w  # per day
        t_fail = rng.expovariate(hazard) * 86_400 if hazard > 0 else float("inf")
        user_state, t_user = self._user_outcome(cls.gpus, n, dur)
        jid = self.next_id
        self.next_id += 1
        user = USERS[jid % len(USERS)]
        nodes = self._nodelist(block)
        submit = self._submit(n, user, jid)
        failed = ""
        if t_fail < min(dur, t_user):
            end = start + max(1, int(t_fail))
            state, failed = self._infra_failure(block, end,
                                                (normal_w, transient_w, lemon_w, fabric_w))
            code, sig = (1, 0) if state == "FAILED" else (0, 0)
        else:
            end = start + max(1, int(min(dur, t_user)))
            state = user_state if t_user <= dur else "COMPLETED"
            code, sig = {"FAILED": (1, 0), "OUT_OF_MEMORY": (0, 9), "CANCELLED": (0, 15),
                         "TIMEOUT": (0, 0)}.get(state, (0, 0))
        return Run(jid, cls.gpus, nodes, n, state, code, sig, start, end, user, submit, failed)

    def _place(self, n: int, on: str = "") -> list[str]:
        """``on``: the block must hold that node (its aligned block, or one of its nodes
        swapped for it)."""
        avail, rng = self.avail, self.rng
        if on:
            if n == 1:
                return [on]
            width = 1 << (n - 1).bit_length()
            if self.fleet.placement == "gang" and width <= len(avail):
                i = min(self.position[on] // width * width, len(avail) - n)
                if on in avail[i:i + n]:
                    return avail[i:i + n]
            block = self._place(n)
            if on not in block:
                block[rng.randrange(n)] = on
            return sorted(block, key=self.position.__getitem__)
        if self.fleet.placement == "random":
            return sorted(rng.sample(avail, n), key=self.position.__getitem__)
        if self.fleet.placement == "gang" and n > 1:
            # Topology-aware packing: blocks aligned to the job's size (a power of two).
            width = 1 << (n - 1).bit_length()
            slots = max(1, (len(avail) - n) // width + 1)
            i = rng.randrange(slots) * width
            return avail[i:i + n]
        i = rng.randrange(len(avail) - n + 1)
        return avail[i:i + n]

    def _user_outcome(self, gpus: int, n: int, dur: float) -> tuple[str, float]:
        p, rng = self.p, self.rng
        if gpus >= BIG_GPUS:
            return "COMPLETED", float("inf")
        failed = p.user_failed_one_node if n == 1 else p.user_failed_gang
        r = rng.random()
        for state, prob in (("FAILED", failed), ("CANCELLED", p.cancelled),
                            ("OUT_OF_MEMORY", p.oom)):
            if r < prob:
                return state, rng.random() * dur
            r -= prob
        if r < p.timeout:
            return "TIMEOUT", dur
        return "COMPLETED", float("inf")

    def _nodelist(self, block: list[str]) -> str:
        if len(block) == 1:
            return block[0]
        # A run placed to hold the busy node may not be one range.
        if self.contiguous and self.position[block[-1]] - self.position[block[0]] == len(block) - 1:
            pre = self.fleet.prefix
            a, b = block[0][len(pre):], block[-1][len(pre):]
            return f"{pre}[{a}-{b}]"
        return compress(block)

    def _infra_failure(self, block: list[str], at: int,
                       weights: tuple[float, ...]) -> tuple[str, str]:
        """(state, the node Slurm records as failed, "" for none)."""
        p, rng = self.p, self.rng
        n = len(block)
        cause = rng.choices(("normal", "transient", "lemon", "fabric"), weights)[0]
        if cause == "fabric":
            return "FAILED", ""  # an NCCL timeout: no node to blame, no node event
        if cause == "lemon":
            node = rng.choice([x for x in block if x in self.lemons])
            if n > 1 and rng.random() < self.fleet.lemon_silent:
                return "FAILED", ""  # a flaky link: the collective dies, nothing names it
            found = rng.random() < p.lemon_detected
        else:
            node = rng.choice([x for x in block if x not in self.lemons] or block)
            found = cause == "normal"
        if found:
            # Health gating drains it (XID 79 style); the node is away a day for repair.
            # The epilog after the failed job finds it.
            why = health_reason(f"xid 79 on GPU {rng.randrange(8)}", "epilog")
            self.events.append(Event(node, at + 30, at + 86_400, "DRAIN",
                                     f"{REASON_PREFIX} {why}", "root"))
            return ("FAILED", "") if n == 1 or rng.random() < 0.5 else ("NODE_FAIL", node)
        self.events.append(Event(node, at, at + 600, "DOWN*", "Not responding", "root"))
        return "NODE_FAIL", node


# A record as Slurm 24.11's `sacct --json` (data_parser v0.0.42) prints it, in its key order
# and layout (two-space indents), less the fields nobody reads from an export. Allocated TRES
# as a GPU node reports them (AccountingStorageTRES always tracks cpu, mem, node, billing).
CPUS_PER_NODE = 112
MEM_PER_NODE_MB = 2_000_000


def _num(field: str) -> dict[str, object]:
    return {"set": True, "infinite": False, "number": f"@{field}@"}


_SAMPLE: dict[str, object] = {
    "account": "research", "allocation_nodes": "@n@", "cluster": CLUSTER,
    "time": {"elapsed": "@elapsed@", "eligible": "@submission@", "end": "@end@",
             "start": "@start@", "submission": "@submission@", "suspended": 0,
             "limit": _num("limit")},
    "exit_code": {"status": ["@status@"], "return_code": _num("code"),
                  "signal": {"id": {"set": "@sigset@", "infinite": False, "number": "@sig@"},
                             "name": ""}},
    "failed_node": "@failed@", "flags": ["STARTED_ON_SCHEDULE"], "group": "@user@",
    "job_id": "@id@", "name": "train", "nodes": "@nodes@", "partition": "gpu",
    "qos": "normal", "restart_cnt": 0,
    "state": {"current": ["@state@"], "reason": "None"},
    "steps": [], "submit_line": "@submit@",
    "tres": {"allocated": [
        {"type": "cpu", "name": "", "id": 1, "count": "@cpus@"},
        {"type": "mem", "name": "", "id": 2, "count": "@mem@"},
        {"type": "node", "name": "", "id": 4, "count": "@n@"},
        {"type": "billing", "name": "", "id": 5, "count": "@cpus@"},
        {"type": "gres", "name": "gpu", "id": 1001, "count": "@gpus@"}]},
    "user": "@user@",
}
# Fields that are JSON values as given (numbers, booleans, an encoded string), not text.
_RAW = ("n", "elapsed", "submission", "end", "start", "limit", "code", "sigset", "sig", "id",
        "cpus", "mem", "gpus", "submit")


def _template() -> str:
    text = json.dumps(_SAMPLE, indent=2).replace("{", "{{").replace("}", "}}")
    text = "\n".join("    " + line for line in text.splitlines())  # an element of "jobs"
    for f in _RAW:
        text = text.replace(f'"@{f}@"', "{" + f + "}")
    return re.sub(r"@(\w+)@", r"{\1}", text)


_RECORD = _template()


def _slurm_json(value: object, indent: int | None = None) -> str:
    # Slurm's serializer escapes every "/" (data_parser\/v0.0.42); JSON allows both.
    return json.dumps(value, indent=indent).replace("/", "\\/")


def sacct_record(r: Run) -> str:
    status = "SUCCESS" if r.state == "COMPLETED" else ("SIGNALED" if r.signal else "ERROR")
    # The time limit (minutes) the run asked for: a TIMEOUT ran into it, the rest ended sooner.
    limit = -(-(r.end - r.start) // 60) if r.state == "TIMEOUT" else 24 * 60
    return _RECORD.format(id=r.job_id, user=r.user, nodes=r.nodes, n=r.num_nodes,
                          state=r.state, status=status, code=r.exit_code,
                          sigset="true" if r.signal else "false", sig=r.signal,
                          submission=r.start - 60, start=r.start, end=r.end,
                          elapsed=r.end - r.start, limit=max(limit, 1),
                          cpus=CPUS_PER_NODE * r.num_nodes, mem=MEM_PER_NODE_MB * r.num_nodes,
                          gpus=r.gpus, submit=_slurm_json(r.submit), failed=r.failed_node)


def _utc(ts: int | None) -> str:
    # As `TZ=UTC SLURM_TIME_FORMAT=standard` sacct and sacctmgr print times (docs/lemons.md).
    return "Unknown" if ts is None else datetime.fromtimestamp(ts, UTC).strftime(
        "%Y-%m-%dT%H:%M:%S")


def sacct_meta(lo: int, hi: int) -> dict[str, object]:
    """`meta` as Slurm writes it: its command line names the export's window, which the
    reader holds the file to (a run counts in the window it ended in)."""
    return {
        "plugin": {"type": "", "name": "", "data_parser": "data_parser/v0.0.42",
                   "accounting_storage": "accounting_storage/slurmdbd"},
        "client": {"source": "", "user": "root", "group": "root"},
        "command": ["sacct", "--json", "--allusers", "--allocations", "--duplicates",
                    f"--starttime={_utc(lo)}", f"--endtime={_utc(hi)}"],
        "slurm": {"version": {"major": "24", "micro": "5", "minor": "11"},
                  "release": "24.11.5", "cluster": CLUSTER}}


def sacct_document(records: Iterable[str], lo: int, hi: int) -> Iterator[str]:
    """The pieces of one day's export: "jobs", then "meta", "errors", "warnings", as sacct
    lays them out."""
    yield '{\n  "jobs": ['
    first = True
    for rec in records:
        yield ("\n" if first else ",\n") + rec
        first = False
    meta = _slurm_json(sacct_meta(lo, hi), indent=2).replace("\n", "\n  ")
    yield ("\n  ],\n" if not first else "],\n") + f'  "meta": {meta},\n  "errors": [],\n' \
        '  "warnings": []\n}\n'


def events_text(events: list[Event], start: int | None = None) -> str:
    """`sacctmgr -P -n show events format=Cluster,NodeName,TimeStart,TimeEnd,State,Reason,User`;
    with ``start``, led by the cluster's own registration event, as slurmdbd records it."""
    uid = {"root": 0}
    head = f"{CLUSTER}||{_utc(start)}|Unknown||Cluster Registered TRES|\n" if start else ""
    return head + "".join(
        f"{CLUSTER}|{e.node}|{_utc(e.start)}|{_utc(e.end)}|{e.state}|{e.reason}|"
        f"{e.user}({uid.get(e.user, 1000)})\n" for e in sorted(events, key=lambda e: e.start))


@dataclass(frozen=True)
class Written:
    files: tuple[Path, ...]
    events: Path
    truth: Path
    records: int  # distinct runs (a run that crossed midnight is listed in both days' files)
    lemons: tuple[str, ...]
    busy: str = ""  # the busy node (`Fleet.busy`), "" for none


def write_history(p: SimParams, fleet: Fleet, out: Path,
                  progress: Callable[[int, int], None] | None = None) -> Written:
    """The history as a site exports it (docs/lemons.md): under ``out/sacct/``, one
    `sacct --json` file per day, each listing every run that overlaps its day, as sacct's
    --starttime/--endtime do; the events (``out/events.txt``); and the truth
    (``out/truth.json``: which nodes are lemons)."""
    (out / "sacct").mkdir(parents=True, exist_ok=True)
    gen = Generator(p, fleet)
    files, records = [], 0
    going: list[Run] = []  # runs from earlier days still running when this day began
    for day, runs in gen.runs():
        lo = fleet.start + day * 86_400
        hi = lo + 86_400
        listed = going + runs
        path = out / "sacct" / f"day{day + 1:03d}.json"
        with path.open("w", encoding="utf-8") as fh:
            fh.writelines(sacct_document((sacct_record(r) for r in listed), lo, hi))
        files.append(path)
        records += len(runs)
        going = [r for r in listed if r.end >= hi]
        if progress:
            progress(day + 1, fleet.days)
    events = out / "events.txt"
    events.write_text(events_text(gen.events, fleet.start), encoding="utf-8")
    truth = out / "truth.json"
    lemons = tuple(sorted(gen.lemons & set(gen.avail)))
    truth.write_text(json.dumps({"lemons": lemons, "records": records,
                                 "params": asdict(p), "fleet": {
                                     "nodes": fleet.nodes, "days": fleet.days,
                                     "seed": fleet.seed, "exclude": sorted(fleet.exclude)}},
                                indent=1) + "\n", encoding="utf-8")
    return Written(tuple(files), events, truth, records, lemons, gen.busy_node)
