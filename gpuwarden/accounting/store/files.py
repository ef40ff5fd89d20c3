"""Parquet files in the store: one per (export, UTC day of the runs' end), under Hive-style
`day=YYYY-MM-DD/` directories, each written to a temp name beside it and renamed whole. All by
the store's descriptor (`storedir`): a link in the store is never written through, followed
or swept."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from datetime import UTC, datetime

import polars as pl

from gpuwarden.accounting.store.storedir import DAY_RE, Dir, open_day, write_at

log = logging.getLogger(__name__)

NO_DAY = "__HIVE_DEFAULT_PARTITION__"  # Hive's name for a null key: runs without an end
DAY_S = 86_400


def day_name(day: int | None) -> str:
    """The partition of a UTC day number (end_time // 86400)."""
    if day is None:
        return f"day={NO_DAY}"
    return "day=" + datetime.fromtimestamp(day * DAY_S, UTC).strftime("%Y-%m-%d")


def write_days(store: Dir, key: str, df: pl.DataFrame) -> list[str]:
    """``df`` split by the day its runs ended, one new file per day named ``key`` and a fresh
    token (never one a manifest names); the paths written, relative to the store."""
    if df.is_empty():
        return []
    token = secrets.token_hex(4)
    out: list[str] = []
    days = df.with_columns((pl.col("end_time") // DAY_S).alias("_day"))
    for part in days.partition_by("_day", maintain_order=True, include_key=True):
        day = day_name(part.get_column("_day")[0])
        name = f"{key}-{token}.parquet"
        fd = open_day(store, day, create=True)
        assert fd is not None  # made when missing
        try:
            write_file(fd, name, part.drop("_day"))
        finally:
            os.close(fd)
        out.append(f"{day}/{name}")
    return out


def write_file(dir_fd: int, name: str, df: pl.DataFrame) -> None:
    """``df`` to ``name`` in ``dir_fd``: a temp file beside it, fsync, rename."""
    write_at(dir_fd, name, lambda fh: df.write_parquet(fh, compression="zstd", statistics=True))


def remove(store: Dir, rels: Iterable[str]) -> None:
    """The files ``rels`` (written by this process: store names) removed, by descriptor."""
    for rel in rels:
        day, _, name = rel.rpartition("/")
        fd = open_day(store, day, create=False)
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
    replaced export left); empty day directories too. A link is never followed: it is left
    where it is and said. Returns how many files went."""
    gone = 0
    for entry in sorted(os.listdir(store.fd)):
        if DAY_RE.fullmatch(entry):
            gone += _sweep_day(store, entry, keep)
        elif ((entry.startswith(".") and entry.endswith(".tmp"))
              or (entry.startswith("events-") and entry.endswith(".parquet")
                  and entry not in keep)):
            gone += _unlinked(store.fd, entry, str(store.path))
    return gone


def _sweep_day(store: Dir, day: str, keep: set[str]) -> int:
    st = os.stat(day, dir_fd=store.fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        log.warning("%s/%s is %s: left alone", store.path, day,
                    "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory")
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
