"""sacct records decoded by msgspec into typed structs: only the fields gpuwarden reads.

Unknown fields (most of a real record: steps, tres.requested, limits...) are skipped in C, so
a record costs a few microseconds instead of the ~30 that building and walking its whole dict
costs. The schema is strict (a wrong type is an error, never a guess); any chunk it rejects is
decoded again untyped and each of its records goes through `parse.acct_job_from_json`, so
both decoders give the same records and the same errors (tests/unit/test_lemon_fastdecode.py).

Where the document's data_parser version is known (`decoder_for`), the structs are strict:
every field that version prints must be there, so a record missing one fails the typed
decode at no cost per record, and the fallback names the field and version.

Optional: without msgspec (the `lemon` extra) `DECODER` is None and acctstream uses the
standard library, correct but slower.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

from gpuwarden.slurm import dataparser
from gpuwarden.slurm.dataparser import PLACEHOLDER
from gpuwarden.slurm.models import AcctJob

try:
    import msgspec
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    msgspec = None  # type: ignore[assignment]


if msgspec is not None:
    class _Num(msgspec.Struct, gc=False):
        """v0.0.40+'s {"set", "infinite", "number"} wrapper."""

        set: bool = True
        infinite: bool = False
        number: int | None = None

    Number = int | _Num | None

    class _State(msgspec.Struct, gc=False):
        current: str | list[str] | None = None
        reason: str | None = None

    class _Time(msgspec.Struct, gc=False):
        submission: Number = None
        start: Number = None
        end: Number = None

    class _Signal(msgspec.Struct, gc=False):
        id: Number = None

    class _Exit(msgspec.Struct, gc=False):
        return_code: Number = None
        signal: _Signal | None = None

    class _Tres(msgspec.Struct, gc=False):
        type: str | None = None
        name: str | None = None
        count: Number = None

    class _TresSet(msgspec.Struct, gc=False):
        allocated: list[_Tres] | None = None

    def _num(v: Any) -> int | None:
        # The same reading as parse._number, on the typed values.
        if v is None:
            return None
        if isinstance(v, int):
            return v if v < PLACEHOLDER else None
        if not v.set or v.infinite:
            return None
        return v.number  # type: ignore[no-any-return]

    class Run(msgspec.Struct, gc=False):
        """One record, with AcctJob's attributes read from it when asked (a scan reads
        five of them for most records), each exactly as parse.acct_job_from_json reads it."""

        id_: Number = msgspec.field(default=None, name="job_id")
        name_: str | None = msgspec.field(default=None, name="name")
        user_: str | None = msgspec.field(default=None, name="user")
        state_: _State | None = msgspec.field(default=None, name="state")
        partition_: str | None = msgspec.field(default=None, name="partition")
        nodes_: str | None = msgspec.field(default=None, name="nodes")
        allocation_nodes: Number = None
        tres: _TresSet | None = None
        exit_: _Exit | None = msgspec.field(default=None, name="exit_code")
        time: _Time | None = None
        restart_cnt: Number = None
        failed_node_: str | None = msgspec.field(default=None, name="failed_node")
        submit_line_: str | None = msgspec.field(default=None, name="submit_line")

        @property
        def job_id(self) -> int:
            return self.id_ if isinstance(self.id_, int) else (_num(self.id_) or 0)

        @property
        def nodes(self) -> str:
            return self.nodes_ or ""

        @property
        def state(self) -> str:
            st = self.state_
            cur = st.current if st is not None else None
            if isinstance(cur, str):
                cur = [v for v in cur.split(",") if v]
            return ("REQUEUED" if "REQUEUED" in cur else cur[0]) if cur else ""

        @property
        def start_time(self) -> int | None:
            t = self.time
            if t is None:
                return None
            v = t.start if isinstance(t.start, int) else _num(t.start)
            # v0.0.43+ prints an unset time as the raw NO_VAL64 (earlier ones as null).
            return v if v and v < PLACEHOLDER else None

        @property
        def end_time(self) -> int | None:
            t = self.time
            if t is None:
                return None
            v = t.end if isinstance(t.end, int) else _num(t.end)
            return v if v and v < PLACEHOLDER else None

        @property
        def gpus(self) -> int:
            total = 0
            if self.tres is not None and self.tres.allocated:
                for t in self.tres.allocated:
                    if t.type == "gres" and t.name == "gpu":
                        total += _num(t.count) or 0
            return total

        @property
        def exit_code(self) -> int | None:
            return None if self.exit_ is None else _num(self.exit_.return_code)

        @property
        def user(self) -> str:
            return self.user_ or ""

        @property
        def restart_count(self) -> int | None:
            return _num(self.restart_cnt)

        @property
        def failed_node(self) -> str:
            return self.failed_node_ or ""

        @property
        def submit_line(self) -> str:
            return self.submit_line_ or ""

        def job(self) -> AcctJob:
            ex, tm, st = self.exit_, self.time, self.state_
            sig = _num(ex.signal.id) if ex is not None and ex.signal is not None else None
            sub = _num(tm.submission) if tm is not None else None
            return AcctJob(self.job_id, self.name_ or "", self.user, self.state,
                           (st.reason or "") if st is not None else "", self.partition_ or "",
                           self.nodes, _num(self.allocation_nodes) or 0, self.gpus,
                           self.exit_code, sig, sub or None, self.start_time, self.end_time,
                           _num(self.restart_cnt), self.failed_node, self.submit_line)

    # The same structs with every field a version prints required (dataparser._SACCT):
    # a missing one is a ValidationError, and the untyped fallback says which.
    class _StateS(_State, kw_only=True, gc=False):
        current: str | list[str] | None
        reason: str | None

    class _TimeS(_Time, kw_only=True, gc=False):
        submission: Number
        start: Number
        end: Number

    class _SignalS(_Signal, kw_only=True, gc=False):
        id: Number

    class _ExitS(_Exit, kw_only=True, gc=False):
        return_code: Number
        signal: _SignalS | None

    class _TresSetS(_TresSet, kw_only=True, gc=False):
        allocated: list[_Tres] | None

    class _RunV40(Run, kw_only=True, gc=False):
        id_: Number = msgspec.field(name="job_id")
        name_: str | None = msgspec.field(name="name")
        user_: str | None = msgspec.field(name="user")
        state_: _StateS | None = msgspec.field(name="state")
        partition_: str | None = msgspec.field(name="partition")
        nodes_: str | None = msgspec.field(name="nodes")
        allocation_nodes: Number
        # Optional: only GPU counts come from it (0 without), and exports trimmed to what the
        # lemon scan reads leave it out.
        tres: _TresSetS | None = None
        exit_: _ExitS | None = msgspec.field(name="exit_code")
        time: _TimeS | None
        failed_node_: str | None = msgspec.field(name="failed_node")
        submit_line_: str | None = msgspec.field(name="submit_line")

    class _RunV42(_RunV40, kw_only=True, gc=False):
        restart_cnt: Number  # new in v0.0.42

    _RUNS = frozenset({Run, _RunV40, _RunV42})

    def _gpus(r: Run) -> int:
        # Run.gpus, with the common cases (a name that is not "gpu"; a plain count) inline.
        tres = r.tres
        if tres is None or not tres.allocated:
            return 0
        total = 0
        for t in tres.allocated:
            if t.name == "gpu" and t.type == "gres":
                c = t.count
                total += c if type(c) is int and c < PLACEHOLDER else (_num(c) or 0)
        return total

    _TYPED = msgspec.json.Decoder(list[Run])
    _STRICT = {40: msgspec.json.Decoder(list[_RunV40]), 42: msgspec.json.Decoder(list[_RunV42])}
    _UNTYPED = msgspec.json.Decoder()


Decoder = Callable[[str, Callable[[Any], Any], bool], "list[Any] | None"]


def _decode(text: str, record: Callable[[Any], Any], lazy: bool,
            typed: Any = None) -> list[Any] | None:
    """``text`` is a JSON array of sacct records: the records (`Run`s if ``lazy``, else
    AcctJobs; errors as ``record`` gives them, called once per record in order), or None when
    it is not JSON msgspec takes (the caller's cut was not between two records, or a record is
    broken or holds NaN). ``typed``: the strict decoder of a known version."""
    try:
        items = (typed or _TYPED).decode(text)
    except msgspec.ValidationError:
        pass  # valid JSON of another shape: let the untyped path explain each record
    except msgspec.DecodeError:
        return None
    else:
        # A record without a job_id is the only one acct_job_from_json refuses. Most exports
        # print plain ints: one max() over them (None or a wrapper cannot be compared).
        ids: list[Any] = [r.id_ for r in items]
        try:
            plain = not ids or max(ids) < PLACEHOLDER
        except TypeError:
            plain = False
        if plain or all((r.id_ < PLACEHOLDER) if isinstance(r.id_, int)
                        else _num(r.id_) is not None for r in items):
            return items if lazy else [r.job() for r in items]
    try:
        raw = _UNTYPED.decode(text)
    except msgspec.DecodeError:
        return None
    return [record(i) for i in raw] if isinstance(raw, list) else None


DECODER: Decoder | None = _decode if msgspec is not None else None


# Columns of a batch (`gpuwarden.accounting.columns`): each value exactly as the record's property
# gives it (0 for None), read from a Run without a property call where the value is plain.
def nodes_of(records: list[Any]) -> list[str]:
    if msgspec is None:
        return [r.nodes for r in records]
    return [(r.nodes_ or "") if type(r) in _RUNS else r.nodes for r in records]


def partitions_of(records: list[Any]) -> list[str]:
    if msgspec is None:
        return [_partition(r) for r in records]
    return [(r.partition_ or "") if type(r) in _RUNS else _partition(r) for r in records]


def _partition(r: Any) -> str:
    value = getattr(r, "partition", "")
    return value if isinstance(value, str) else ""


def states_of(records: list[Any]) -> list[str]:
    if msgspec is None:
        return [r.state for r in records]
    # A one-element list is the common case: Run.state gives its element.
    return [c[0] if type(r) in _RUNS and (s := r.state_) is not None
            and type(c := s.current) is list and len(c) == 1 else r.state for r in records]


def starts_of(records: list[Any]) -> list[int]:
    if msgspec is None:
        return [r.start_time or 0 for r in records]
    return [v if type(r) in _RUNS and (t := r.time) is not None and type(v := t.start) is int
            and 0 < v < PLACEHOLDER else (r.start_time or 0) for r in records]


def ends_of(records: list[Any]) -> list[int]:
    if msgspec is None:
        return [r.end_time or 0 for r in records]
    return [v if type(r) in _RUNS and (t := r.time) is not None and type(v := t.end) is int
            and 0 < v < PLACEHOLDER else (r.end_time or 0) for r in records]


def gpus_of(records: list[Any]) -> list[int]:
    if msgspec is None:
        return [r.gpus for r in records]
    return [_gpus(r) if type(r) in _RUNS else r.gpus for r in records]


def restarts_of(records: list[Any]) -> list[int]:
    if msgspec is None:
        return [r.restart_count or 0 for r in records]
    return [v if type(r) in _RUNS and type(v := r.restart_cnt) is int and 0 < v < PLACEHOLDER
            else (r.restart_count or 0) for r in records]


def decoder_for(version: str | None) -> Decoder | None:
    """The decoder for records of a known data_parser version (strict), else `DECODER`."""
    if version is None or DECODER is not _decode:
        return DECODER  # unknown version, no msgspec, or a decoder swapped in (tests)
    typed = _STRICT[42 if (dataparser.number(version) or 0) >= 42 else 40]

    def strict(text: str, record: Callable[[Any], Any], lazy: bool) -> list[Any] | None:
        return _decode(text, record, lazy, typed)
    return strict


# A store row's fields by type, each group in AcctJob's order (`flat_of`).
INTS = ("job_id", "num_nodes", "gpus", "exit_code", "signal", "submit_time", "start_time",
        "end_time", "restart_count")
STRS = ("name", "user", "state", "state_reason", "partition", "nodes", "failed_node",
        "submit_line")
_INTS, _STRS = attrgetter(*INTS), attrgetter(*STRS)


def flat_of(records: list[Any]) -> tuple[list[Any], list[str]]:
    """Each record's AcctJob fields, the `INTS` of every record in one list and its `STRS` in
    another, record after record (the accounting store's rows: two flat lists make two
    Series, cut into columns in Rust; a tuple per record to transpose cost more than the
    reading). Read from a Run in one step where its values are plain, else through
    ``job()``/the AcctJob."""
    ints: list[Any] = []
    strs: list[str] = []
    add_ints, add_strs = ints.extend, strs.extend
    if msgspec is None:
        for r in records:
            job = _job(r)
            add_ints(_INTS(job))
            add_strs(_STRS(job))
        return ints, strs
    ph, wrapped = PLACEHOLDER, _Num
    for r in records:
        if type(r) not in _RUNS:
            job = _job(r)
            add_ints(_INTS(job))
            add_strs(_STRS(job))
            continue
        tm, st, ex = r.time, r.state_, r.exit_
        cur = st.current if st is not None else None
        if type(cur) is not list or len(cur) != 1 or tm is None or ex is None \
                or type(r.id_) is not int:
            job = r.job()
            add_ints(_INTS(job))
            add_strs(_STRS(job))
            continue
        sub, start, end = tm.submission, tm.start, tm.end
        nn, rc, sig, rs = r.allocation_nodes, ex.return_code, ex.signal, r.restart_cnt
        sig = sig.id if sig is not None else None
        # Each as _num reads it, its common cases (a plain int, a set wrapper) inline.
        add_ints((r.id_, nn if type(nn) is int and nn < ph else _num(nn) or 0, _gpus(r),
                  rc if type(rc) is int and rc < ph else
                  (rc.number if rc.set and not rc.infinite else None) if type(rc) is wrapped
                  else _num(rc),
                  sig if type(sig) is int and sig < ph else
                  (sig.number if sig.set and not sig.infinite else None)
                  if type(sig) is wrapped else _num(sig),
                  (sub if type(sub) is int and 0 < sub < ph else _num(sub) or None)
                  if sub is not None else None,
                  start if type(start) is int and 0 < start < ph else r.start_time,
                  end if type(end) is int and 0 < end < ph else r.end_time,
                  rs if type(rs) is int and rs < ph else _num(rs)))
        add_strs((r.name_ or "", r.user_ or "", cur[0], st.reason or "", r.partition_ or "",
                  r.nodes_ or "", r.failed_node_ or "", r.submit_line_ or ""))
    return ints, strs


def _job(r: Any) -> AcctJob:
    return r if isinstance(r, AcctJob) else r.job()
