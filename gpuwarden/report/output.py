"""Writing the report's files: all or nothing, never through a link.

Each file is written to a new temporary name beside it (exclusive create: never an existing
file, never a link), flushed, then renamed over the final name: a rename replaces a symlink
there rather than writing through it (the admin may run the report as root, in a directory
others can write), and a failure leaves the previous report whole. The JSON is renamed into
place first, so that a page on disk always has its JSON beside it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from gpuwarden.core.errors import GpuwardenError

MODE = 0o644  # a report is for reading
# A file's text, or what makes its bytes when it is written (a year's JSON is 0.3 GB: made
# then, and let go before the next file, rather than held beside the page).
Content = str | Callable[[], Iterable[bytes]]


class OutputError(GpuwardenError):
    pass


def _same(a: str, b: str) -> bool:
    pa, pb = Path(a), Path(b)
    if pa.absolute() == pb.absolute():
        return True
    try:
        return pa.resolve() == pb.resolve() or os.path.samefile(pa, pb)
    except OSError:
        return False


def check_distinct(paths: Sequence[str]) -> None:
    for i, a in enumerate(paths):
        for b in paths[i + 1:]:
            if _same(a, b):
                raise OutputError(f"{a} and {b} are the same file: give the page and the "
                                  "JSON different names")


def _temp(path: str, content: Content) -> str:
    where = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=where)
    try:
        os.fchmod(fd, MODE)
        with os.fdopen(fd, "wb") as fh:
            for chunk in [content.encode("utf-8")] if isinstance(content, str) else content():
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_all(files: Sequence[tuple[str, Content]]) -> None:
    """(path, content) pairs, renamed into place in the order given once every one is
    written (a content that makes its bytes is made as its file is written)."""
    check_distinct([p for p, _ in files])
    done: list[tuple[str, str]] = []
    try:
        for path, content in files:
            if os.path.isdir(path) and not os.path.islink(path):
                raise OutputError(f"{path}: is a directory")
            try:
                done.append((_temp(path, content), path))
            except OSError as exc:
                raise OutputError(f"{path}: cannot write ({exc.strerror})") from None
        for tmp, path in done:
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise OutputError(f"{path}: cannot write ({exc.strerror})") from None
    finally:
        for tmp, _ in done:
            if os.path.lexists(tmp):
                os.unlink(tmp)
