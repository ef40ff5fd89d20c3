"""Parquet files in the store: one per (export, UTC day of the runs' end), under Hive-style
`day=YYYY-MM-DD/` directories, and its rollup (`rollup`) under the same name in
`rollup/day=YYYY-MM-DD/`; each written to a temp name beside it and renamed whole. The
manifest names the runs files; a rollup goes with its runs file (written, removed, kept by the
sweep with it: `rollup_of`). All by the store's descriptor (`storedir`): a link in the store
is never written through, followed or swept."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

import polars as pl

from gpuwarden.accounting.store import rollup
from gpuwarden.accounting.store.storedir import DAY_RE, ROLLUP, Dir, open_day, write_at

log = logging.getLogger(__name__)

NO_DAY = "__HIVE_DEFAULT_PARTITION__"  # Hive's name for a null key: runs without an end
DAY_S = 86_400


def day_name(day: int | None) -> str:
    """The partition of a UTC day number (end_time // 86400)."""
    if day is None:
        return f"day={NO_DAY}"
    return "day=" + datetime.fromtimestamp(day * DAY_S, UTC).strftime("%Y-%m-%d")


def rollup_of(rel: str) -> str:
    """The rollup of the runs file ``rel`` (`day=D/NAME.parquet`), relative to the store."""
    return f"{ROLLUP}/{rel}"


@contextlib.contextmanager
def _rollups(store: Dir, create: bool) -> Iterator[Dir | None]:
    fd = open_day(store, ROLLUP, create)
    if fd is None:
        yield None
        return
    try:
        yield Dir(fd, store.path / ROLLUP)
    finally:
        os.close(fd)


def write_days(store: Dir, key: str, df: pl.DataFrame) -> list[str]:
    """``df`` split by the day its runs ended, one new file per day named ``key`` and a fresh
    token (never one a manifest names), each with its rollup; the runs files' paths,
    relative to the store."""
    if df.is_empty():
        return []
    token = secrets.token_hex(4)
    out: list[str] = []
    with _rollups(store, create=True) as rolled:
        assert rolled is not None  # made when missing
        for number, runs in by_day(df):
            day = day_name(number)
            name = f"{key}-{token}.parquet"
            for where, frame in ((store, runs), (rolled, rollup.of(runs))):
                _write_in(where, day, name, frame)
            out.append(f"{day}/{name}")
    return out


def by_day(df: pl.DataFrame) -> Iterator[tuple[int | None, pl.DataFrame]]:
    """``df``'s rows by the UTC day their run ended (None: no end), each day's in their order,
    the days in the order of their first row."""
    day = df.get_column("end_time") // DAY_S
    runs = day.rle()
    lengths, values = runs.struct.field("len").to_list(), runs.struct.field("value").to_list()
    if len(set(values)) == len(values):
        # Each day's rows together (an export in the order the runs ended): slices, no
        # partitioning. Each made one run of rows (a frame of several batches is in pieces):
        # a piece would be a row group of its own in the day's file.
        at = 0
        for n, value in zip(lengths, values, strict=True):
            yield value, df.slice(at, n).rechunk()
            at += n
        return
    for part in df.with_columns(day.alias("_day")).partition_by("_day", maintain_order=True,
                                                                 include_key=True):
        yield part.get_column("_day")[0], part.drop("_day")


def write_rollup(store: Dir, rel: str, runs: pl.DataFrame) -> None:
    """The rollup of the runs file ``rel`` (its rows ``runs``) written, replacing any."""
    day, _, name = rel.rpartition("/")
    with _rollups(store, create=True) as rolled:
        assert rolled is not None  # made when missing
        _write_in(rolled, day, name, rollup.of(runs))


def _write_in(where: Dir, day: str, name: str, df: pl.DataFrame) -> None:
    fd = open_day(where, day, create=True)
    assert fd is not None  # made when missing
    try:
        write_file(fd, name, df)
    finally:
        os.close(fd)


def write_file(dir_fd: int, name: str, df: pl.DataFrame) -> None:
    """``df`` to ``name`` in ``dir_fd``: a temp file beside it, fsync, rename."""
    write_at(dir_fd, name, lambda fh: df.write_parquet(fh, compression="zstd", statistics=True))


def remove(store: Dir, rels: Iterable[str]) -> None:
    """The runs files ``rels`` (written by this process: store names) and their rollups
    removed, by descriptor."""
    rels = list(rels)
    with _rollups(store, create=False) as rolled:
        for where in (store, *([rolled] if rolled is not None else [])):
            for rel in rels:
                day, _, name = rel.rpartition("/")
                fd = open_day(where, day, create=False)
                if fd is None:
                    continue
                try:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=fd)
                finally:
                    os.close(fd)


def _unlinked(dir_fd: int, name: str, where: str) -> bool:
    """Remove ``name`` when it is a regular file (lstat: a link is left, said)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        log.warning("%s/%s is not a regular file (a link?): left alone", where, name)
        return False
    os.unlink(name, dir_fd=dir_fd)
    return True


def sweep(store: Dir, keep: set[str]) -> int:
    """Remove the Parquet and temp files no manifest names (an ingest that crashed, files a
    replaced export left) and the rollups of runs files it does not name; empty day
    directories too. A link is never followed: it is left where it is and said. Returns how
    many files went."""
    gone = 0
    for entry in sorted(os.listdir(store.fd)):
        if entry == ROLLUP and _is_dir(store, entry):
            with _rollups(store, create=False) as rolled:
                if rolled is not None:
                    gone += sum(_sweep_day(rolled, day, keep)
                                for day in sorted(os.listdir(rolled.fd)) if DAY_RE.fullmatch(day))
        elif DAY_RE.fullmatch(entry):
            gone += _sweep_day(store, entry, keep)
        elif ((entry.startswith(".") and entry.endswith(".tmp"))
              or (entry.startswith("events-") and entry.endswith(".parquet")
                  and entry not in keep)):
            gone += _unlinked(store.fd, entry, str(store.path))
    return gone


def _is_dir(store: Dir, name: str) -> bool:
    st = os.stat(name, dir_fd=store.fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        log.warning("%s/%s is %s: left alone", store.path, name,
                    "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory")
        return False
    return True


def _sweep_day(store: Dir, day: str, keep: set[str]) -> int:
    """``keep``: runs files' names, relative to the store's root; in the rollup directory
    (``store`` then), their rollups are kept."""
    if not _is_dir(store, day):
        return 0
    fd = open_day(store, day, create=False)
    if fd is None:
        return 0
    gone = 0
    try:
        for name in os.listdir(fd):
            if f"{day}/{name}" not in keep and name.endswith((".parquet", ".tmp")):
                gone += _unlinked(fd, name, f"{store.path}/{day}")
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(day, dir_fd=store.fd)  # only when empty
    return gone
