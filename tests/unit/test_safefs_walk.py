"""safefs's one walk from / (gpuwarden.core.safefs._walk), as the entry points use it: what it
follows (root's links in root's directories, as /var/run -> /run and /lib -> usr/lib on
Debian), the sticky directories it accepts above (/tmp, /dev/shm), what it refuses, and the
directories it makes. What every entry point refuses: test_safefs_refusals.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpuwarden.core import safefs
from gpuwarden.core.safefs._walk import MAX_HOPS, Unsafe, ancestor_problem, walk_dir
from gpuwarden.health.store import StateWriteError, Store

from .test_safefs_refusals import ENTRIES, NEW, OTHER_UID, Site, build

ME = os.geteuid()
SYSTEM_UID = 101  # a service's account, as Debian's prometheus user
PERSON_UID = 4242  # a person's: at or above login.defs UID_MIN (1000 here and by default)
as_root = pytest.mark.skipif(ME != 0, reason="needs root (a link of root's, chown)")


def _walk(path: Path) -> int | None:
    return walk_dir(str(path), (ME,), "us")


def _root_link_above(base: Path, kind: str) -> Site:
    """A good site whose ``up`` is root's link (in root's 0700 tmp_path) to where it was."""
    site = build(base, kind, "good")
    up = base / "up"
    up.rename(base / "real-up")
    up.symlink_to(base / "real-up")  # root's: these tests run as root
    return Site(base, site.target, base / "decoy")


@as_root
@pytest.mark.parametrize("name", list(ENTRIES))
def test_a_link_of_roots_in_a_directory_of_roots_is_followed(tmp_path: Path, name: str) -> None:
    """As /var/run -> /run: every entry point works through it (the table's planted links are
    a user's, and refused)."""
    entry = ENTRIES[name]
    site = _root_link_above(tmp_path, entry.kind)
    entry.call(site)
    if entry.side == "write" and entry.kind == "file":
        assert (tmp_path / "real-up" / "p" / "d" / "f").read_bytes() == NEW


@as_root
def test_a_link_of_roots_in_a_directory_others_can_change_is_refused(tmp_path: Path) -> None:
    """Root's link in a sticky /tmp-like directory: the directory is fine above, but whoever
    can write it could have put the name there first; never followed."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    (tmp_path / "real").mkdir()
    (shm / "via").symlink_to(tmp_path / "real")
    with pytest.raises(Unsafe, match=rf"{shm}/via is a symbolic link in {shm}, which someone "
                                     "other than root can change"):
        _walk(shm / "via" / "d")


@as_root
def test_a_users_link_is_refused_naming_it_and_its_owner(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    os.lchown(tmp_path / "via", OTHER_UID, OTHER_UID)
    with pytest.raises(Unsafe, match=rf"{tmp_path}/via is a symbolic link of uid {OTHER_UID}"):
        _walk(tmp_path / "via" / "d")


@as_root
def test_relative_and_absolute_links_are_followed_hop_by_hop(tmp_path: Path) -> None:
    """/lib -> usr/lib (relative, with ..), then an absolute one, then a link to a link."""
    (tmp_path / "usr" / "lib" / "d").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "lib").symlink_to("../usr/lib")
    (tmp_path / "abs").symlink_to(tmp_path / "etc" / "lib")
    (tmp_path / "again").symlink_to("abs")
    want = os.stat(tmp_path / "usr" / "lib" / "d")
    for via in ("etc/lib/d", "abs/d", "again/d"):
        fd = _walk(tmp_path / via)
        assert fd is not None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        assert (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino), via


@as_root
def test_a_loop_of_links_stops_at_the_hop_limit(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(Unsafe, match="too many levels of symbolic links"):
        _walk(tmp_path / "a" / "d")
    assert MAX_HOPS == 40


@as_root
def test_the_named_directory_itself_is_never_followed_even_when_roots(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    with pytest.raises(safefs.StateDirError, match=r"via is a symbolic link, not a directory"):
        safefs.check_private_dir(str(tmp_path / "via"))


@as_root
@pytest.mark.parametrize(("owner", "mode", "refused"), [
    (0, 0o1777, ""),  # /tmp, /dev/shm: others add entries, never rename ours
    (OTHER_UID, 0o1777, f"owned by uid {OTHER_UID}"),
    (0, 0o777, "writable by group or others"),
    (0, 0o2775, "writable by group or others"),  # Debian's /var/local (root:staff)
    (OTHER_UID, 0o755, f"owned by uid {OTHER_UID}"),
    # Debian's node_exporter textfile directory, /var/lib/prometheus/node-exporter (root's),
    # is in the prometheus user's home: a system account's is fine above, a person's is not.
    (SYSTEM_UID, 0o755, ""),
    (SYSTEM_UID, 0o1777, "sticky, but not root's"),
    (PERSON_UID, 0o755, f"owned by uid {PERSON_UID}, not by root or a system account "
                        f"\\(uid below 1000\\), as a directory above one root uses must be: "
                        "chown root"),
])
def test_what_a_directory_above_may_be(tmp_path: Path, owner: int, mode: int,
                                       refused: str) -> None:
    above = tmp_path / "above"
    above.mkdir()
    (above / "spool").mkdir(mode=0o700)
    os.chown(above, owner, owner)
    above.chmod(mode)
    if refused:
        with pytest.raises(safefs.Refused, match=f"{above} .*{refused}"):
            safefs.open_spool(str(above / "spool"))
    else:
        os.close(safefs.open_spool(str(above / "spool")))


def test_a_sticky_directory_above_must_be_roots(tmp_path: Path) -> None:
    """Even one of the expected owner's: whoever owns a sticky directory may rename in it."""
    st = os.stat(tmp_path)
    sticky = os.stat_result((stat.S_IFDIR | 0o1777, *st[1:4], OTHER_UID, *st[5:]))
    assert "sticky, but not root's" in ancestor_problem("/x", sticky, (OTHER_UID,), "them")
    assert ancestor_problem("/x", sticky, (OTHER_UID,), "them").startswith("/x ")


def test_a_missing_directory_on_the_way_is_absent_not_refused(tmp_path: Path) -> None:
    assert _walk(tmp_path / "no" / "such") is None
    assert safefs.read_private(str(tmp_path / "no" / "such" / "f")) is None
    assert safefs.check_private_dir(str(tmp_path / "no")) is False
    assert safefs.read_plain(str(tmp_path / "no" / "f")) == b""
    with pytest.raises(FileNotFoundError):
        safefs.open_spool(str(tmp_path / "no"))
    with pytest.raises(FileNotFoundError):  # the spool's last component only is made
        os.close(safefs.ensure_spool(str(tmp_path / "no" / "spool")))


def test_made_directories_have_their_modes_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        safefs.ensure_private_dir(str(tmp_path / "a" / "b" / "state"))
        safefs.ensure_private_dir(str(tmp_path / "prom"), mode=0o755)
        with safefs.opened_dir(str(tmp_path / "kit" / "bin"), ME, create=True) as fd:
            assert fd is not None
    finally:
        os.umask(old)

    def mode(rel: str) -> int:
        return stat.S_IMODE(os.lstat(tmp_path / rel).st_mode)

    assert (mode("a"), mode("a/b"), mode("a/b/state")) == (0o755, 0o755, 0o700)
    assert (mode("prom"), mode("kit"), mode("kit/bin")) == (0o755, 0o755, 0o755)


def test_a_file_read_through_a_directory_fd_is_named_by_its_path(tmp_path: Path) -> None:
    """ELOOP from a name in a directory fd names the whole path, not the bare name."""
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    (d / "f").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match=f"{d}/f"):
        safefs.read_private(str(d / "f"))


# The node_exporter textfile writer (Store._write_prom): its directory vetted as root's own.
def test_the_textfile_is_not_written_into_a_directory_others_can_write(tmp_path: Path) -> None:
    prom = tmp_path / "prom"
    prom.mkdir()
    prom.chmod(0o777)
    with pytest.raises(StateWriteError, match=f"{prom} .*writable by group or others"):
        Store(str(tmp_path / "state"), str(prom)).save_self({"state": "x"}, 0.0)
    assert list(prom.iterdir()) == []


def test_the_textfile_directory_is_made_readable_by_node_exporter(tmp_path: Path) -> None:
    prom = tmp_path / "lib" / "node_exporter" / "textfile"
    Store(str(tmp_path / "state"), str(prom)).save_self({}, 5.0)
    assert stat.S_IMODE(prom.stat().st_mode) == 0o755
    assert stat.S_IMODE((prom / Store.SELF_PROM).stat().st_mode) == 0o644


@as_root
def test_the_textfile_goes_into_debians_node_exporter_directory(tmp_path: Path) -> None:
    """Debian's prometheus-node-exporter: /var/lib/prometheus is the prometheus user's home
    (chowned by its postinst), /var/lib/prometheus/node-exporter root's 0755."""
    home = tmp_path / "var" / "lib" / "prometheus"
    prom = home / "node-exporter"
    prom.mkdir(parents=True)
    os.chown(home, SYSTEM_UID, SYSTEM_UID)
    Store(str(tmp_path / "state"), str(prom)).save_self({"state": "ok"}, 5.0)
    assert (prom / Store.SELF_PROM).stat().st_uid == 0
