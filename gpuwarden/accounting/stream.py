"""`sacct --json` read as a stream: one job record at a time, from a file or a running sacct.

A busy cluster's day of accounting is hundreds of MB of JSON; decoding it whole costs about
8.5 KB of memory per job. Here only the top-level object is walked by hand: each element of
"jobs" is decoded on its own (the standard library's C decoder, `raw_decode`, on a sliding
buffer) and handed on, so memory holds one buffer and one record whatever the size.
With msgspec installed (`gpuwarden.accounting.fastdecode`), the records in each ~1 MB of the buffer
are decoded in one call into typed structs of only the fields gpuwarden reads: about 10x
faster than the standard library (which stays as the fallback, and for the first and last
record of the list).

The cut that ends such a batch must fall between two records, and "},{" alone does not tell:
compact output has it inside every record (the TRES lists). The cut is looked for first as
the text between the first two records up to the second's first key (`},{"account":`
compact; with a newline and Slurm's indentation as it prints): no string can hold it (its
quotes would end the string), and the lists inside sacct's records hold objects that start
with other keys ("type" in the TRES lists). A cut the decoder refuses (a list inside a record
did hold one) switches the stream to finding each record's end with `jsonspans`: one
regular-expression pass that skips strings and balances brackets. Either way each character
is scanned and decoded about once, so the cost is linear in the input whatever its layout
(tests/unit/test_acct_compact.py).

Slurm writes "meta" (with the command line, hence the export's window, and the data_parser
version) after "jobs", so the window and version of a file are read first from its tail
(`file_window`, `file_version`); the document's other top-level keys are available from
`AcctStream.top` once the records are exhausted. Given the version, records are checked
against its schema (strict structs in acctfast: no cost per record) and an error names the
record's place and the missing field ("jobs[3].time.end missing").
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, Protocol

from gpuwarden.accounting import fastdecode as acctfast
from gpuwarden.accounting import jsonspans
from gpuwarden.core.errors import SlurmError, SlurmParseError
from gpuwarden.slurm import dataparser, parse
from gpuwarden.slurm.dataparser import Source
from gpuwarden.slurm.models import AcctJob
from gpuwarden.slurm.runner import SLURM_ENV, CommandTimeoutError

log = logging.getLogger(__name__)

CHUNK = 1 << 20
MAX_VALUE = 64 << 20  # one record (or meta) this large is not sacct's output
TAIL = 1 << 20
_WS = re.compile(r"[ \t\n\r]*")
# From the end of one record to the first key of the next: the cut the fast path looks for.
_SEP = re.compile(r'[ \t\n\r]*,[ \t\n\r]*\{[ \t\n\r]*"[^"\\]*+(?:\\.[^"\\]*+)*+"[ \t\n\r]*:')
_META = re.compile(r'"meta"[ \t\n\r]*:[ \t\n\r]*\{')
_DECODE = json.JSONDecoder().raw_decode


def decoder_name() -> str:
    """Which decoder the records go through, for the log."""
    if acctfast.DECODER is not None:
        return "msgspec"
    return "the standard library (msgspec, in the `lemon` extra, is several times faster)"


class AcctReader(Protocol):
    """Accounting for one window, streamed. Raises CommandTimeoutError (possibly after some
    records) when the window took longer than the deadline: the caller splits it."""

    def window(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]: ...


class _Buffer:
    """Text read in chunks from ``read``; ``pos`` moves forward, consumed text is dropped."""

    def __init__(self, read: Callable[[int], str], what: str) -> None:
        self._read = read
        self._what = what
        self.text = ""
        self.pos = 0
        self.eof = False
        self.offset = 0  # characters dropped before text[0], for error messages

    def _more(self) -> None:
        if len(self.text) - self.pos > MAX_VALUE:
            raise SlurmParseError(f"{self._what}: a value of more than {MAX_VALUE >> 20} MB at "
                                  f"character {self.offset + self.pos}")
        chunk = self._read(CHUNK)
        if self.pos > CHUNK:
            # What is left and the new chunk in one string: one copy, not two.
            self.offset += self.pos
            self.text, self.pos = self.text[self.pos:] + chunk, 0
        elif chunk:
            self.text += chunk
        if not chunk:
            self.eof = True

    def fill(self, n: int) -> None:
        """At least ``n`` characters after ``pos`` in ``text``, or all there are."""
        while len(self.text) - self.pos < n and not self.eof:
            self._more()

    def peek(self) -> str:
        """The next character that is not white space ('' at the end)."""
        while True:
            self.pos = _WS.match(self.text, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.text) or self.eof:
                return self.text[self.pos:self.pos + 1]
            self._more()

    def expect(self, chars: str) -> str:
        c = self.peek()
        if not c or c not in chars:
            raise SlurmParseError(f"{self._what}: expected {' or '.join(chars)!s} at character "
                                  f"{self.offset + self.pos}, found {c or 'the end'!r}")
        self.pos += 1
        return c

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                obj, end = _DECODE(self.text, self.pos)
            except json.JSONDecodeError as exc:
                if self.eof:
                    raise self.not_json(exc) from None
                # Twice the text before decoding again: a value longer than a chunk costs a
                # few decodes, not one per chunk (`_more` still refuses one past MAX_VALUE).
                self.fill(2 * (len(self.text) - self.pos))
                continue
            if end == len(self.text) and not self.eof:
                self._more()  # a number or literal may go on in the next chunk
                continue
            self.pos = end
            return obj

    def not_json(self, exc: json.JSONDecodeError) -> SlurmParseError:
        return SlurmParseError(f"{self._what}: not JSON ({exc.msg} at character "
                               f"{self.offset + exc.pos})")


class AcctRecord(Protocol):
    """What a scan reads of a record: an AcctJob, or the fast decoder's lazy `acctfast.Run`."""

    @property
    def job_id(self) -> int: ...
    @property
    def user(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def nodes(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def start_time(self) -> int | None: ...
    @property
    def end_time(self) -> int | None: ...
    @property
    def failed_node(self) -> str: ...
    @property
    def submit_line(self) -> str: ...
    @property
    def restart_count(self) -> int | None: ...


class AcctStream:
    """Iterate for the records (or `runs` for the lighter ones a scan reads); afterwards
    ``top`` holds the other top-level keys."""

    def __init__(self, read: Callable[[int], str], what: str = "sacct --json",
                 fast: bool = True, version: str | None = None) -> None:
        """``version``: the data_parser version the export names (`file_version`), to check
        each record against; None reads any version's records leniently."""
        self._buf = _Buffer(read, what)
        self._decode = acctfast.decoder_for(version) if fast else None
        self._src = Source(what, version)
        self._n = 0  # records read so far: the next one's index in "jobs"
        self._lazy = False
        self._lists = False  # yield lists of records (`run_batches`)
        self._what = what
        self._saw_jobs = False
        self._sep: str | None = None
        self.top: dict[str, Any] = {}

    def __iter__(self) -> Iterator[AcctJob | SlurmError]:
        return self._walk()

    def runs(self) -> Iterator[AcctRecord | SlurmError]:
        """The records, each an AcctJob or (fast decoder) a `acctfast.Run` that reads its
        fields only when asked: building every AcctJob was a quarter of a scan."""
        self._lazy = True
        return self._walk()

    def run_batches(self) -> Iterator[list[AcctRecord | SlurmError]]:
        """`runs`, as the lists they are decoded in (a list per call of the fast decoder):
        no step per record for a caller that takes them a batch at a time."""
        self._lazy = self._lists = True
        return self._walk()

    def _one(self, r: AcctJob | SlurmError) -> Any:
        return [r] if self._lists else r

    def _walk(self) -> Iterator[Any]:
        b = self._buf
        b.expect("{")
        if b.peek() == "}":
            b.pos += 1
        else:
            while True:
                key = b.value()
                b.expect(":")
                if key == "jobs" and b.peek() == "[":
                    yield from self._jobs()
                else:
                    self.top[str(key)] = b.value()
                if b.expect(",}") == "}":
                    break
        if b.peek():
            raise SlurmParseError(f"{self._what}: text after the JSON document")
        _check_errors(self.top, self._what)
        if not self._saw_jobs:
            raise SlurmParseError(f"{self._what}: no 'jobs' list")

    def _jobs(self) -> Iterator[Any]:
        b = self._buf
        self._saw_jobs = True
        b.expect("[")
        if b.peek() == "]":
            b.pos += 1
            return
        yield self._one(self._record(b.value()))
        if self._decode is not None:
            b.fill(CHUNK)
            m = _SEP.match(b.text, b.pos)
            self._sep = "}" + m.group() if m else None
        if b.expect(",]") == "]":
            return
        while True:
            if self._decode is not None:
                yield from self._batches()
            # The last, or one the fast path could not take.
            yield self._one(self._record(b.value()))
            if b.expect(",]") == "]":
                return

    def _batches(self) -> Iterator[Any]:
        """Many records per call of the fast decoder, up to a record the caller reads the slow
        way: ``pos`` is left at an element of "jobs"."""
        b = self._buf
        decode = self._decode
        assert decode is not None
        while True:
            b.fill(CHUNK)
            if self._sep is not None:
                cut = b.text.rfind(self._sep, b.pos)
                if cut >= 0:
                    n = self._n
                    # One string made (an f-string joins at once): a copy of each MB fewer.
                    jobs = decode(f"[{b.text[b.pos:cut + 1]}]", self._record, self._lazy)
                    if jobs is not None:
                        self._count(n, jobs)
                        yield from self._each(jobs)
                        b.pos = cut + self._sep.index("{")
                        continue
                    # Refused: the separator is inside records here (or one is not JSON
                    # msgspec takes); find each record's end from now on.
                    self._sep = None
            spans, after = jsonspans.object_spans(b.text, b.pos)
            if not spans:
                return
            n = self._n
            jobs = decode("[" + b.text[spans[0][0]:spans[-1][1]] + "]", self._record,
                          self._lazy)
            if jobs is not None:
                self._count(n, jobs)
                yield from self._each(jobs)
            else:
                # One of them is not JSON msgspec takes (NaN, a broken record): the standard
                # library says which, or reads it as the slow path would.
                for start, _ in spans:
                    yield self._one(self._at(start))
            b.pos = after

    def _each(self, jobs: list[Any]) -> Iterator[Any]:
        if self._lists:
            yield jobs
        else:
            yield from jobs

    def _at(self, start: int) -> AcctJob | SlurmError:
        b = self._buf
        try:
            obj, _ = _DECODE(b.text, start)
        except json.JSONDecodeError as exc:
            raise b.not_json(exc) from None
        return self._record(obj)

    def _record(self, item: Any) -> AcctJob | SlurmError:
        """One element of "jobs", read the slow way (counted, for its place in errors)."""
        at = parse.At("jobs", self._n)
        self._n += 1
        return parse.acct_record(item, self._src, at)

    def _count(self, before: int, jobs: list[Any]) -> None:
        # The fast decoder calls _record only when it falls back; otherwise count the batch.
        if self._n == before:
            self._n += len(jobs)


def _check_errors(top: Mapping[str, Any], what: str) -> None:
    errors = top.get("errors") or []
    if isinstance(errors, list) and errors:
        first = errors[0] if isinstance(errors[0], Mapping) else {}
        desc = first.get("description") or first.get("error") or str(errors[0])
        raise SlurmParseError(f"{what}: Slurm reported an error: {desc}")


def record(item: Any) -> AcctJob | SlurmError:
    """One element of "jobs": the record, or why it is not one (never stops the scan)."""
    return parse.acct_record(item)


def open_regular(path: str) -> IO[bytes]:
    """An export to read: no links followed, no FIFO (O_NONBLOCK), a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SlurmError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def text_reader(fh: IO[bytes]) -> Callable[[int], str]:
    """Bytes to text incrementally (a character split across chunks stays whole); a UTF-8
    byte-order mark at the start (an export saved by an editor or PowerShell) is dropped."""
    dec = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")

    def read(n: int) -> str:
        while True:
            data = fh.read(n)
            text = dec.decode(data, final=not data)
            if text or not data:
                return text
    return read


def file_meta(fh: IO[bytes]) -> Mapping[str, Any] | None:
    """An export's "meta", from near its end (where Slurm writes it); None when the tail holds
    none. ``fh`` is left at the start."""
    size = os.fstat(fh.fileno()).st_size
    fh.seek(max(0, size - TAIL))
    tail = fh.read(TAIL).decode("utf-8", errors="replace")
    fh.seek(0)
    for m in reversed(list(_META.finditer(tail))):
        try:
            meta, _ = _DECODE(tail, m.end() - 1)
        except json.JSONDecodeError:
            continue
        if isinstance(meta, Mapping):
            return meta
    return None


def file_window(fh: IO[bytes]) -> tuple[float | None, float | None]:
    """The --starttime/--endtime of an export, from its "meta"; (None, None) when the tail
    holds none (the caller checks again after reading)."""
    meta = file_meta(fh)
    return (None, None) if meta is None else parse.acct_window({"meta": meta})


def file_version(fh: IO[bytes]) -> str | None:
    """The data_parser version an export names in its "meta" (for `AcctStream`'s version)."""
    meta = file_meta(fh)
    return None if meta is None else dataparser.version(meta)


class SacctStream:
    """The real `AcctReader`: sacct's stdout decoded as it arrives, under a hard deadline
    (the process is killed when it passes)."""

    def __init__(self, sacct: Callable[[], str], timeout_s: float) -> None:
        self._sacct = sacct  # the sacct executable, resolved at the first call
        self._timeout_s = timeout_s

    def argv(self, start: str, end: str) -> list[str]:
        # --json last: before 26.05.2 meta.command lacks argv's last element, and the window
        # must survive in it (parse.acct_window).
        return [self._sacct(), "--allusers", "--allocations", "--duplicates",
                f"--starttime={start}", f"--endtime={end}", "--json"]

    def window(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]:
        return run_streamed(self.argv(start, end), self._timeout_s)


def run_streamed(argv: Sequence[str], timeout_s: float) -> Iterator[AcctJob | SlurmError]:
    with tempfile.TemporaryFile() as err:  # stderr to a file: a full pipe cannot stall sacct
        try:
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=err,
                                    stdin=subprocess.DEVNULL, env=SLURM_ENV)
        except OSError as exc:
            raise SlurmError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            proc.kill()
        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            assert proc.stdout is not None
            stream = AcctStream(text_reader(proc.stdout), f"{argv[0]} --json")
            try:
                yield from stream
            except SlurmParseError:
                if not expired.is_set():
                    raise
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        if expired.is_set():
            raise CommandTimeoutError(argv, timeout_s)
        if rc != 0:
            err.seek(0)
            msg = err.read(4096).decode(errors="replace").strip()
            raise SlurmError(f"`{' '.join(argv)}` failed (exit {rc}): {msg}")
