"""FileCoordinator's writes from two threads of one process at once (the floor thread's
publish beside close's last one, `ckpt.floor0`): each lands whole, never a mix of the two."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.ckpt import coord


def test_two_threads_publishing_at_once_never_mix_their_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = coord.FileCoordinator(str(tmp_path), 0, 1)
    opened, second_done = threading.Event(), threading.Event()
    real = json.dump

    def dump(value: Any, fh: Any, **kw: Any) -> None:
        if threading.current_thread().name == "first":
            opened.set()  # its temp file is open; the other write goes all the way first
            assert second_done.wait(10)
        real(value, fh, **kw)

    monkeypatch.setattr(coord.json, "dump", dump)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            c.publish_durable("memory", 9)
        except OSError as exc:  # a write that lost its file is an error, never a mix
            errors.append(exc)

    t = threading.Thread(target=first, name="first")
    t.start()
    assert opened.wait(10)
    c.publish_durable("memory", 12)
    second_done.set()
    t.join(10)
    got = json.loads((tmp_path / "coord" / "durable-memory.rank-0").read_text())
    assert got in (9, 12), f"the file holds {got}, which neither thread wrote"
