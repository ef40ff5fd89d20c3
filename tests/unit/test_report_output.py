"""The report's files written all or nothing (`report.output.write_all`), a content that makes
its bytes made as its file is written: a year's JSON is 0.3 GB, and held as text beside the
page and the report it set the report's peak memory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.report.output import OutputError, write_all


def test_a_content_is_made_as_its_file_is_written(tmp_path: Path) -> None:
    made: list[str] = []

    def json_bytes() -> Iterator[bytes]:
        made.append("json")
        yield b'{"a": "\xc3\xa9"}'
        yield b"\n"

    page, doc = tmp_path / "r.html", tmp_path / "r.json"
    write_all([(str(doc), json_bytes), (str(page), "<p>\u00e9</p>")])
    assert made == ["json"]
    assert doc.read_bytes() == b'{"a": "\xc3\xa9"}\n'
    assert page.read_text(encoding="utf-8") == "<p>\u00e9</p>"
    assert oct(doc.stat().st_mode & 0o777) == oct(0o644)


def test_a_content_that_fails_leaves_every_file_as_it_was(tmp_path: Path) -> None:
    page, doc = tmp_path / "r.html", tmp_path / "r.json"
    page.write_text("old page")

    def failing() -> Iterator[bytes]:
        yield b"half"
        raise MemoryError("no room for the JSON")

    with pytest.raises(MemoryError):
        write_all([(str(doc), failing), (str(page), "new page")])
    assert page.read_text() == "old page" and not doc.exists()
    assert sorted(os.listdir(tmp_path)) == ["r.html"]  # no temporary file left


def test_a_directory_in_the_way_is_named(tmp_path: Path) -> None:
    (tmp_path / "r.json").mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        write_all([(str(tmp_path / "r.json"), lambda: (b"{}",)),
                   (str(tmp_path / "r.html"), "page")])
    assert not (tmp_path / "r.html").exists()
