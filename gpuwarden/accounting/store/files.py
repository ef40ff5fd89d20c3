"""Parquet files in the store: one per (export, UTC day of the runs' end), under Hive-style
`day=YYYY-MM-DD/` directories, each written to a temp name beside it and renamed whole."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import polars as pl

NO_DAY = "__HIVE_DEFAULT_PARTITION__"  # Hive's name for a null key: runs without an end
DAY_S = 86_400


def day_name(day: int | None) -> str:
    """The partition of a UTC day number (end_time // 86400)."""
    if day is None:
        return f"day={NO_DAY}"
    return "day=" + datetime.fromtimestamp(day * DAY_S, UTC).strftime("%Y-%m-%d")


def write_days(store: Path, key: str, df: pl.DataFrame) -> list[str]:
    """``df`` split by the day its runs ended, one new file per day named ``key`` and a fresh
    token (never one a manifest names); the paths written, relative to ``store``."""
    if df.is_empty():
        return []
    token = secrets.token_hex(4)
    out: list[str] = []
    days = df.with_columns((pl.col("end_time") // DAY_S).alias("_day"))
    for part in days.partition_by("_day", maintain_order=True, include_key=True):
        day = part.get_column("_day")[0]
        rel = f"{day_name(day)}/{key}-{token}.parquet"
        write_file(store / rel, part.drop("_day"))
        out.append(rel)
    return out


def write_file(path: Path, df: pl.DataFrame) -> None:
    """``df`` to ``path``: a temp file beside it, fsync, rename (complete or absent)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        df.write_parquet(tmp, compression="zstd", statistics=True)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def remove(store: Path, rels: Iterable[str]) -> None:
    for rel in rels:
        with contextlib.suppress(FileNotFoundError):
            (store / rel).unlink()


def sweep(store: Path, keep: set[str]) -> int:
    """Remove the Parquet and temp files no manifest names (an ingest that crashed, files a
    replaced export left); empty day directories too. Returns how many files went."""
    gone = 0
    for d in store.glob("day=*"):
        if not d.is_dir():
            continue
        for f in d.iterdir():
            rel = f"{d.name}/{f.name}"
            if rel not in keep and (f.suffix in (".parquet", ".tmp")) and f.is_file():
                f.unlink()
                gone += 1
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty
    for f in store.glob(".*.tmp"):
        f.unlink()
        gone += 1
    for f in store.glob("events-*.parquet"):
        if f.name not in keep:
            f.unlink()
            gone += 1
    return gone
