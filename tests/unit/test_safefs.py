"""gpuwarden.core.safefs itself: the package's names, and the tests of its primitives gathered
from the features that use them (the verdict store, gating on a full disk, the checkpoint
epilog's removal). What every entry point refuses: test_safefs_refusals.py."""

from __future__ import annotations

import ast
import errno
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.core import safefs
from gpuwarden.core.safefs import StateDirError, ensure_private_dir

# The package's one list of names -------------------------------------------------------------


def test_every_public_name_comes_from_the_submodule_the_package_names() -> None:
    assert sorted(safefs.__all__) == sorted(safefs._HOME)
    for name, home in safefs._HOME.items():
        module = __import__(f"gpuwarden.core.safefs.{home}", fromlist=[name])
        assert getattr(safefs, name) is getattr(module, name), name


def test_the_type_checkers_imports_name_the_same_homes() -> None:
    """The TYPE_CHECKING block (what mypy sees) and _HOME (what runs) must agree."""
    tree = ast.parse(Path(safefs.__file__).read_text())
    [block] = [node for node in tree.body if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    seen = {alias.name: str(node.module).rsplit(".", 1)[1] for node in block.body
            if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert seen == safefs._HOME


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = safefs.nothing_here  # type: ignore[attr-defined]


def test_reading_a_private_file_loads_only_what_it_needs() -> None:
    """The prolog's fast gate imports read_private from the package: not the spool's mmap,
    nor installwrite's contextlib."""
    code = ("import sys; from gpuwarden.core.safefs import read_private, StateDirError; "
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, "
                          f"{str(Path(__file__).resolve().parents[2])!r}); {code}"],
                         capture_output=True, text=True, check=True, timeout=30)
    loaded = set(out.stdout.split())
    assert "gpuwarden.core.safefs.privfile" in loaded
    for heavy in ("gpuwarden.core.safefs.spool", "gpuwarden.core.safefs.installwrite",
                  "gpuwarden.core.safefs.atomic", "mmap", "contextlib", "typing", "importlib"):
        assert heavy not in loaded, heavy


# atomic (was gpuwarden.health.store) ---------------------------------------------------------
# From test_deadline_store.py.


def test_a_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StateDirError, match="not a directory"):
        ensure_private_dir(str(tmp_path / "state"))


def test_a_group_writable_state_dir_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(StateDirError, match="chmod go-w"):
        ensure_private_dir(str(d))


# From test_never_silently_off.py.


def enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_short_write_still_gives_a_complete_file(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data[:7])))
    data = b"x" * 1000
    safefs.atomic_write(str(tmp_path), "v.json", data)
    monkeypatch.undo()
    assert (tmp_path / "v.json").read_bytes() == data


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "v.json").write_bytes(b"old")
    monkeypatch.setattr(os, "fsync", enospc)
    with pytest.raises(OSError):
        safefs.atomic_write(str(tmp_path), "v.json", b"new")
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["v.json"]
    assert (tmp_path / "v.json").read_bytes() == b"old"


# spool (was gpuwarden.ckpt.safeio): removal ---------------------------------------------------
# From test_ckpt_mallory.py (issue 12, item 2: a deep tree planted where the epilog removes).


def deep_tree(parent: Path, name: str, depth: int) -> None:
    with safefs.closing(os.open(parent, os.O_RDONLY)) as fd:
        os.mkdir(name, dir_fd=fd)
        cur = os.open(name, os.O_RDONLY, dir_fd=fd)
    for _ in range(depth):
        os.mkdir("d", dir_fd=cur)
        (Path(f"/proc/self/fd/{cur}") / "f").write_bytes(b"x")
        nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)


@pytest.fixture
def deep_scratch() -> Iterator[Path]:
    """Not tmp_path: pytest's own cleanup of old temp dirs recurses, and a tree left behind by a
    failing run would crash every later pytest session with RecursionError. rm(1) does not."""
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-deep-"))
    try:
        yield base
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def test_removal_takes_a_tree_deeper_than_python_recurses_with_few_descriptors(
        deep_scratch: Path) -> None:
    tmp_path = deep_scratch
    deep_tree(tmp_path, "deep", 1500)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 200), hard))
    try:
        with safefs.closing(os.open(tmp_path, os.O_RDONLY)) as fd:
            assert safefs.remove_at(fd, "deep")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not (tmp_path / "deep").exists()


def test_removal_stops_at_its_bound_and_says_what_it_left(tmp_path: Path) -> None:
    deep_tree(tmp_path, "wide", 50)
    with safefs.closing(os.open(tmp_path, os.O_RDONLY)) as fd, \
            pytest.raises(safefs.Refused, match="left in place"):
        safefs.remove_at(fd, "wide", max_entries=20)
