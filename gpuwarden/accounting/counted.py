"""Failed runs whose exposure was tallied with the plain runs, judged without redoing it: the
accounting store's way (`accounting.store.scan`). Pure.

The store tallies the exposure of every run with start and end times and a node list
`hostranges.shape` reads (no node with a cleared lemon drain) on columns, failed or not; what is
left per failed run is its judgement (rules 1-4, and rule 8's claims), which is what
`attribution._attribute_one` does after the exposure. Here it is done with what repeats per
node list worked out once (its names, its size, which of its nodes have failure events, their
rows in the incidence), since a failed gang run's nodes are most of the work: at 10 million
records, about a million blames. The per-record path stays the reference:
tests/unit/test_attribution_counted.py checks both give the same Attribution.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from gpuwarden.accounting.attribution import (
    LEAD_S,
    MIN_RUN_S,
    NODE_STATES,
    Attribution,
    HealthDrain,
    Held,
    Pending,
    _attribute_one,
    _rule,
    _submit_facts,
    gpu_class,
    run_seconds,
    size_bucket,
)
from gpuwarden.accounting.columns import Columns
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.stream import AcctRecord
from gpuwarden.accounting.submit import ALL_NODES
from gpuwarden.slurm.hostlist import _MAX_EXPAND
from gpuwarden.slurm.hostranges import expanded, shape

BLAMABLE = frozenset({*NODE_STATES, "REQUEUED", "FAILED"})


def countable(text: str) -> bool:
    """Whether a failed run on ``text`` can be judged here: a list `shape` reads, that
    `hostlist.expand` names without refusing it (too many names). The caller also leaves out
    lists with a node whose lemon drain was cleared (rule 7)."""
    known = shape(text) if text else None
    return known is not None and known[1] <= _MAX_EXPAND


def _names(text: str) -> tuple[str, ...]:
    """``text``'s names from its ranges, as `hostlist.expand` names them (`hostranges`)."""
    got = expanded(text)
    assert got is not None, text  # `countable`
    return got


class _List:
    """What judging a failed run reads of its node list, worked out once per list."""

    __slots__ = ("_scope", "bits", "blamed", "ixs", "n", "names", "size", "weight",
                 "with_events")

    def __init__(self, text: str, failures: Mapping[str, list[HealthDrain]]) -> None:
        self.names = _names(text)
        self.n = len(self.names)
        self.size = size_bucket(self.n)
        self.weight = 1.0 / self.n if self.n else 0.0  # a plain blame's, spread over them
        self._scope: frozenset[str] | None = None
        # In the list's order: `_claims` looks at each node's events in that order.
        self.with_events = tuple(n for n in self.names if n in failures)
        # The names' incidence numbers and their numbers in the blames (`Blames`), once a
        # plain run on the list is blamed: int32s, joined at once into both (`Judge.flush`).
        self.ixs: array[int] | None = None
        self.blamed: array[int] | None = None
        # Which time buckets hold an event of one of ``with_events`` (`_Buckets`), made once
        # the list's first run is judged; None: not made (or one node: a bisection is as fast).
        self.bits: int | None = None

    @property
    def scope(self) -> frozenset[str]:
        """The names as a set, made for the few runs that name a node (a year's lists as
        sets held about 50 MB at the read's peak)."""
        if self._scope is None:
            self._scope = frozenset(self.names)
        return self._scope


# A plain blamed run as `Judge.flush` writes it: (job id, end, hours, size, incidence numbers,
# user, script, gameable, blames' numbers, weight, reason, pinned, start, GPU class).
_Plain = tuple[int, int, float, int, "array[int]", str, str, bool, "array[int]", float, str,
               bool, int, int]
# Plain blamed runs held before they are written (`Judge.flush`): a year's million, held to the
# end of the read as tuples, were half a GiB of the report's peak.
FLUSH_AT = 65_536


class Rows(Protocol):
    """A batch of runs by column (the store's: `store.schema.Batch`)."""

    def __len__(self) -> int: ...
    def column(self, name: str) -> Sequence[Any]:
        """The field ``name`` (`AcctJob`'s) of every run, in order."""
    def records(self, lo: int = 0, hi: int | None = None) -> Sequence[AcctRecord]:
        """The runs from ``lo`` to ``hi`` (the end: None) as records."""


# What `Judge.add_rows` reads of each run, in its order.
_READ = ("job_id", "nodes", "state", "start_time", "end_time", "gpus", "user", "exit_code",
         "failed_node", "submit_line")


class _Buckets:
    """The failure events' times in buckets at least `LEAD_S` + grace wide, a node's or a
    list's as the bits of an int: a run's end window [end - `LEAD_S`, end + grace] falls in
    at most two buckets (three, read here, for rounding), so no bit set there says no event
    of the list's nodes is near the end with one shift, where a gang's nodes with events were
    each a bisection (a year's 47k lists, most runs with none near)."""

    SPAN = 1 << 16  # buckets at most: a list's bits in 8 KiB (a year: 8,000 of an hour)

    def __init__(self, failures: Mapping[str, list[HealthDrain]], grace_s: float) -> None:
        times = [d.at for ds in failures.values() for d in ds]
        lo, hi = (min(times), max(times)) if times else (0.0, 0.0)
        self.width = max(LEAD_S + grace_s, (hi - lo) / self.SPAN, 1.0)
        self.base = math.floor(lo / self.width)
        self.failures = failures
        self._nodes: dict[str, int] = {}

    def _of(self, node: str) -> int:
        got = self._nodes.get(node)
        if got is None:
            got = 0
            for d in self.failures[node]:
                got |= 1 << (math.floor(d.at / self.width) - self.base)
            self._nodes[node] = got
        return got

    def of(self, nodes: Iterable[str]) -> int:
        """The buckets of ``nodes``' events."""
        out = 0
        for n in nodes:
            out |= self._of(n)
        return out

    def none_near(self, bits: int, end: int) -> bool:
        """Whether ``bits`` say no event is from `LEAD_S` before ``end`` to the grace after
        (False: there may be)."""
        k = math.floor((end - LEAD_S) / self.width) - self.base
        if k >= 0:
            return not (bits >> k) & 7
        return k < -2 or not (bits << -k) & 7


class Judge:
    """Judges the counted failed runs into one Attribution (`add`), in the order given."""

    def __init__(self, result: Attribution, drains: Mapping[str, list[HealthDrain]],
                 failures: Mapping[str, list[HealthDrain]], grace_s: float) -> None:
        self.result, self.drains, self.failures, self.grace_s = result, drains, failures, grace_s
        self._lists: dict[str, _List] = {}
        self._times: dict[str, tuple[list[float], list[int]]] = {}
        # Plain blamed runs (no culprit, no node named) not yet written, in order (`flush`).
        self._plain: list[_Plain] = []
        # `_rule`'s reason by (state, node count, exit code): all it reads of a counted run.
        self._reasons: dict[tuple[str, int, int | None], str | None] = {}
        self._buckets: _Buckets | None = None

    def flush(self) -> None:
        """The plain blamed runs written into the incidence and the blames, by column: the
        caller's before anything else writes to them, so that the order stays the runs'."""
        if not self._plain:
            return
        rows, self._plain = self._plain, []
        (job_ids, ends, hours, sizes, ixs, users, scripts, gameable, numbers, weights,
         reasons, pinned, started, gpus) = zip(*rows, strict=True)
        self.result.incidence.add_plain_failures(job_ids, ends, hours, sizes, ixs, users,
                                                 scripts, gameable)
        self.result.blames.add_runs(numbers, weights, job_ids, ends, reasons, sizes, pinned,
                                    started, gpus)

    def _by_time(self, node: str) -> tuple[list[float], list[int]]:
        """``node``'s failure events' times in order, and their positions in its list: the
        events of a failed run's nodes around its end are found by bisection (`add`); each
        failed run looked at every event of its nodes, which over a year of a fleet was most
        of `fleet mttf` (45 of 49 s at 12M runs)."""
        got = self._times.get(node)
        if got is None:
            ds = self.failures[node]
            order = sorted(range(len(ds)), key=lambda i: ds[i].at)
            got = self._times[node] = ([ds[i].at for i in order], order)
        return got

    def _near_end(self, facts: _List, end: int, found: list[HealthDrain]
                  ) -> list[HealthDrain]:
        """``found`` and after it each failure event of ``facts``' nodes from `LEAD_S` before
        ``end`` to the grace after, in the list's order, once each (`_claims`' rule 2 part)."""
        lo, hi = end - LEAD_S, end + self.grace_s
        times_of, failures = self._times, self.failures
        for n in facts.with_events:
            times, order = times_of.get(n) or self._by_time(n)
            a, b = bisect_left(times, lo), bisect_right(times, hi)
            if a == b:
                continue  # most runs: none of the node's events near the end
            ds = failures[n]
            for i in sorted(order[a:b]):  # in the node's list's order
                d = ds[i]
                if d not in found:
                    found.append(d)
        return found

    def _claims(self, facts: _List, state: str, start: int, end: int
                ) -> tuple[tuple[HealthDrain, ...], tuple[HealthDrain, ...]]:
        """`attribution._claims` of a run on ``facts``' list: (rule 4's drains, every event
        it could use)."""
        if state == "FAILED" and facts.n == 1:
            # Rule 4's drains, then the node's failures near the end (found by bisection: a
            # drained node has had many).
            got = [d for d in self.drains.get(facts.names[0], ())
                   if start <= d.at <= end + self.grace_s]
            if not got:
                return (), ()
            return tuple(got), tuple(self._near_end(facts, end, got))
        # Whether any event is near the end, by one bisection a node: most runs have none
        # (`_near_end` finds which). Two nodes or more: first by the list's buckets.
        ev = facts.with_events
        if len(ev) > 1:
            buckets = self._buckets
            if buckets is None:
                buckets = self._buckets = _Buckets(self.failures, self.grace_s)
            bits = facts.bits
            if bits is None:
                bits = facts.bits = buckets.of(ev)
            if buckets.none_near(bits, end):
                return (), ()
        lo, hi = end - LEAD_S, end + self.grace_s
        times_of = self._times
        for n in ev:
            times = (times_of.get(n) or self._by_time(n))[0]
            a = bisect_left(times, lo)
            if a < len(times) and times[a] <= hi:
                return (), tuple(self._near_end(facts, end, []))
        return (), ()

    def add_rows(self, rows: Rows, lo: int, hi: int) -> None:
        """The failed runs ``lo`` to ``hi`` of ``rows``, in order (each: a state in `BLAMABLE`,
        start and end times, a `countable` node list with no cleared node): `_attribute_one`
        after the exposure, read off the columns (no record each: a year has a million)."""
        col = rows.column
        lists, failures, grace_s = self._lists, self.failures, self.grace_s
        pending, reasons = self.result.pending, self._reasons
        result = self.result
        gpu_failures, keep = result.gpu_failures, result.blames_on
        pinned_by_size, spread_by_size = result.pinned_by_size, result.spread_by_size
        plain = self._plain
        classes: dict[int, int] = {}
        for job_id, text, state, start, end, gpus, user, exit_code, failed_node, line in zip(
                *(col(c)[lo:hi] for c in _READ), strict=True):
            facts = lists.get(text)
            if facts is None:
                facts = lists[text] = _List(text, failures)
            all_nodes = facts.names
            gclass = classes.get(gpus)
            if gclass is None:
                gclass = classes[gpus] = gpu_class(gpus)
            # No node with an event and not rule 4's: no claims (most gangs of a few nodes).
            if facts.with_events or (facts.n == 1 and state == "FAILED"):
                drained, claims = self._claims(facts, state, start, end)
                if claims:  # rule 8: judged once every run that may claim them is in
                    pending.append(Pending(
                        Held(job_id, user, state, exit_code, failed_node, line), all_nodes,
                        all_nodes, start, end, facts.size, gclass, claims, drained))
                    continue
            if state == "REQUEUED":
                continue  # a requeue no node failure explains (rule 2)
            key = (state, facts.n, exit_code)
            try:
                reason = reasons[key]
            except KeyError:
                # `_rule` reads the state, the exit code and the node count; rule 4's drains
                # were `_claims`'.
                reason = reasons[key] = _rule(Held(job_id, user, state, exit_code, failed_node,
                                                   line), all_nodes, {}, grace_s, start, end)
            if reason is None:
                continue  # the user's (rule 4)
            gpu_failures[gclass] += 1
            if keep is None and not (state in NODE_STATES and failed_node in facts.scope):
                named, script = _submit_facts(line)
                if not named:
                    # `_blame`'s most common way, here: a plain run (no culprit, no node
                    # named), its failure spread over its nodes (a call each was a second).
                    if facts.ixs is None:
                        facts.ixs = array("i", result.incidence.node_numbers(all_nodes))
                        facts.blamed = array("i", result.blames.numbers(all_nodes))
                    assert facts.blamed is not None
                    pinned = facts.n == 1
                    (pinned_by_size if pinned else spread_by_size)[facts.size] += facts.n
                    plain.append((job_id, end, max(end - start, MIN_RUN_S) / 3600, facts.size,
                                  facts.ixs, user, script, state == "FAILED", facts.blamed,
                                  facts.weight, reason, pinned, start, gclass))
                    if len(plain) >= FLUSH_AT:
                        self.flush()
                        plain = self._plain
                    continue
            self._blame(job_id, state, user, failed_node, line, facts, start, end, reason,
                        gclass)
            plain = self._plain  # `_blame` may have flushed it

    def _blame(self, job_id: int, state: str, user: str, failed_node: str, line: str,
               facts: _List, start: int, end: int, reason: str, gclass: int) -> None:
        """`attribution._blame` for a run no failure event names a node of (no claims)."""
        result, all_nodes = self.result, facts.names
        culprits: list[str] = []
        if state in NODE_STATES and failed_node in facts.scope:
            culprits = [failed_node]  # sacct's own record of the node that failed
            reason += f"; Slurm recorded {failed_node} as the node that failed"
        keep = result.blames_on
        if keep is not None:  # no incidence; only the blames on ``keep``'s nodes
            targets = culprits or all_nodes
            pinned = len(all_nodes) == 1 or bool(culprits)
            (result.pinned_by_size if pinned else result.spread_by_size)[facts.size] += \
                len(targets)
            kept = [n for n in targets if n in keep]
            result.blames.add_run(result.blames.numbers(kept), 1.0 / len(targets), job_id,
                                  float(end), reason, facts.size, pinned, float(start), gclass)
            return
        named, script = _submit_facts(line)
        if named:
            named = facts.scope if named == ALL_NODES else named & facts.scope
        hours = run_seconds(start, end) / 3600
        gameable = state == "FAILED" and not culprits
        targets = culprits or all_nodes
        pinned = len(all_nodes) == 1 or bool(culprits)
        (result.pinned_by_size if pinned else result.spread_by_size)[facts.size] += len(targets)
        if not (culprits or named):  # most: a gang's failure spread over its nodes
            if facts.ixs is None:
                facts.ixs = array("i", result.incidence.node_numbers(all_nodes))
                facts.blamed = array("i", result.blames.numbers(all_nodes))
            assert facts.blamed is not None
            plain = self._plain
            plain.append((job_id, end, hours, facts.size, facts.ixs, user, script,
                          gameable, facts.blamed, 1.0 / len(targets), reason, pinned, start,
                          gclass))
            if len(plain) >= FLUSH_AT:
                self.flush()
            return
        self.flush()
        result.incidence.add_failure(job_id, float(end), hours, facts.size, all_nodes,
                                     culprits, named, user, script, gameable=gameable)
        blames = result.blames
        blames.add_run(blames.numbers(culprits or all_nodes), 1.0 / len(targets), job_id,
                       float(end), reason, facts.size, pinned, float(start), gclass)


def attribute_rest(result: Attribution, batches: Iterable[tuple[Rows, Sequence[bool]]],
                   drains: Mapping[str, list[HealthDrain]],
                   failures: Mapping[str, list[HealthDrain]], clears: Mapping[str, float],
                   grace_s: float, ranged: RangeTally) -> None:
    """The runs of ``batches`` (runs and which are counted), in order: the ``counted`` ones
    judged by one `Judge` off the columns (their exposure is the caller's), the others made
    records, each as `attribute_runs` does one record."""
    judge = Judge(result, drains, failures, grace_s)
    for rows, counted in batches:
        n = len(rows)
        at = 0
        while at < n:  # spans of counted runs, then of the others
            fast = counted[at]
            try:
                end = counted.index(not fast, at)
            except ValueError:
                end = n
            if fast:
                judge.add_rows(rows, at, end)
            else:
                judge.flush()
                recs = rows.records(at, end)
                cols = Columns(recs)
                for i, rec in enumerate(recs):
                    _attribute_one(result, rec, cols, i, drains, failures, clears, grace_s,
                                   ranged)
            at = end
    judge.flush()
